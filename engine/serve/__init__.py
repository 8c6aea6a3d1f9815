"""`kvharbor serve`: the OpenAI API server (server, api_server, openai_responses, embeddings_api),
its link to the engine core process (core_client, core_process, engine_loop; framed by
engine/link_frames.py), its metrics and its SLO window. The core itself, and everything it runs,
lives one level up."""
