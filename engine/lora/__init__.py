"""LoRA adapters: reading and checking one (adapter), the engine's set of loaded adapters
(lora_manager) and the slots one step runs them from (lora_slots)."""
