"""The transformers architectures llmtrain-hf reads and writes, by name. Imported at every
`llmtrain` start (the CLI's choices), so it imports neither torch nor transformers."""

from __future__ import annotations

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
OLMO2 = "Olmo2ForCausalLM"
GPT2 = "GPT2LMHeadModel"
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2, GPT2)
