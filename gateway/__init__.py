"""kvharbor gateway: the tenants' OpenAI-compatible front door (see gateway/README.md)."""
