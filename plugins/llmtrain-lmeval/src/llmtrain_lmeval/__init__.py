"""llmtrain-lmeval: llmtrain checkpoints in lm-evaluation-harness.

`lm_eval --model llmtrain --model_args checkpoint=DIR --tasks ...` scores a checkpoint with
llmtrain's downstream scorer (`llmtrain_lmeval.model.LLMTrainLM`). Importing this package only
arranges for `llmtrain` to join lm-eval's model names when lm-eval loads them
(`llmtrain_lmeval.registration`); it imports neither lm-eval nor torch.
"""

from __future__ import annotations

from llmtrain_lmeval.registration import MODEL_NAME, register, watch

__all__ = ["MODEL_NAME", "register", "watch"]

watch()
