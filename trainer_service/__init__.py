"""The trainer service: serves the model with vLLM and trains LoRA checkpoints with GRPO.

Modules, by part (each module's docstring says more):

* settings: `config` (the service's `TrainerSettings`), `grpo_config` (`GRPOConfig`), `base_model`
  (model resolution and the served name), `cgroup_memory` (the memory limit a KV cache must fit), `vllm_source`
  (what the installed vLLM accepts, read from its source);
* training: `collector_client` (leases and acks), `batching` (groups to training items), `retokenize`
  (chat-template masks for foreign trajectories), `grpo` (pure GRPO maths), `training` (`LoRATrainer`:
  GRPO and SFT steps), `packed_pass` (a pass's log-probs and losses), `lora_forward`,
  `packed_attention`, `logprobs` (the step's fused ops), `distributed` (data-parallel steps under
  torchrun), `checkpoints`, `checkpoint_folder`, `checkpoint_checks` and `durable` (checkpoint folders: the
  run's, one written and read, whether the kept ones fit), `metrics` (every metrics sink);
* serving: `engine` (vLLM supervisor), `engine_adapters` (the adapters it serves and re-loads), `vllm_launch` (vLLM's
  port held between starts, its log), `engine_errors`, `backoff` (its retry waits, and the acks' and releases' to the
  collector), `vllm_lora_api` (vLLM's adapter endpoints), `stoppable` (waits that stopping
  gives up), `process_group` and `parent_death` (stopping it), the vLLM plugins `vllm_cpu_lora`, `vllm_cpu_matmul`,
  `vllm_cpu_norm`, `vllm_cpu_seeds`, `vllm_cpu_threads`, and the CPU's `core_lending`, `allocator`, `huge_pages`;
* the service: `evaluation`, `promotion` and `promotion_state` (the promotion gate), `retention` (which checkpoints
  stay), `schedule` (min-groups / interval / cron triggers), `schedule_text` (reading `--every` and `--cron`),
  `service` (train/serve logic), `step_bookkeeping` (a step's ack, metrics record and unserved answer),
  `service_status` (`GET /v1/status`), `failed_steps` (what becomes of a failed step's batch, and the fix a 507
  names), `server` (HTTP layer), `proxy` (its relay of chat requests to vLLM), `protocol` (wire models), `cli`
  (`art-trainer`).
"""
