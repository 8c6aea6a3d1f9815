"""`kvharbor serve`: the OpenAI API server (server, api_server, openai_responses), its link to the
engine core process (core_client, core_link, core_process, engine_loop), its metrics and its SLO
window. The core itself, and everything it runs, lives one level up."""
