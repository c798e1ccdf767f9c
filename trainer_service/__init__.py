"""The trainer service: serves the model with vLLM and trains LoRA checkpoints with GRPO.

Modules: `config` (settings), `grpo` (pure GRPO maths), `batching` (groups → training items),
`retokenize` (chat-template masks for foreign trajectories), `training` (LoRA trainer: GRPO and
SFT steps), `checkpoints` (folders, retention), `evaluation` and `promotion` (the promotion
gate), `metrics` (every metrics sink), `schedule` (min-groups / interval / cron triggers),
`engine` (vLLM supervisor), `service` (train/serve logic), `server` (HTTP layer), `protocol`
(wire models), `cli` (`art-trainer`), `base_model` (model resolution).
"""
