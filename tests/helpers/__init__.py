"""Test helpers shared by the test folders (import as `from helpers.tiny_models import ...`).

Tiny checkpoints, media and prompts (`tiny_models`, `tiny_videos`, `mm_prompts`), the engine and
server runners (`core_client_runs`, `parity_runs`, `server_process`, `fake_engine`,
`shm_items_for_tests`), the scheduler simulator (`scheduler_sim`), the Hugging Face references
(`hf_reference`, `hf_video`, `hf_logits`), the GPU cases and Triton's set-up (`gpu_cases`, `triton_device`).
"""
