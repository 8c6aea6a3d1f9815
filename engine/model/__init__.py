"""The model wing: a Llama-family decoder over a flat token batch (`decoder.py`) and its shape
(`arch.py`), RoPE (`rope.py`), paged attention (`attention.py`; `attention_triton.py` on GPUs),
reading weights (`loader.py`, `gguf_loader.py`, `gguf_blocks.py`), the device and dtype
(`device.py`), and the transformers reference tests compare against (`hf_reference.py`)."""
