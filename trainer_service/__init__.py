"""The trainer service: serves the model with vLLM and trains LoRA checkpoints with GRPO.

Modules: `config` (settings), `grpo` (pure GRPO maths), `training` (LoRA trainer),
`engine` (vLLM supervisor), `service` (train/serve logic), `server` (HTTP layer),
`protocol` (wire models), `cli` (`art-trainer`), `base_model` (model resolution).
"""
