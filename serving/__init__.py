"""kvtopo inside serving engines: the entry points other engines load (see docs/vllm.md)."""
