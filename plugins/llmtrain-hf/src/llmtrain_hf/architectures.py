"""The transformers architectures llmtrain-hf reads and writes, by name. Imported at every
`llmtrain` start (the CLI's choices), so it imports neither torch nor transformers."""

from __future__ import annotations

LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
OLMO2 = "Olmo2ForCausalLM"
GEMMA2 = "Gemma2ForCausalLM"
# Gemma 3's text model (model_type gemma3_text); Gemma3ForConditionalGeneration adds vision
GEMMA3 = "Gemma3ForCausalLM"
GPT2 = "GPT2LMHeadModel"
# Mixture-of-Experts architectures: models of llmtrain-moe (`llmtrain_hf.moe`)
OLMOE = "OlmoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
MOE_ARCHITECTURES = (OLMOE, QWEN3_MOE, MIXTRAL)
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2, GEMMA2, GEMMA3, GPT2, *MOE_ARCHITECTURES)
