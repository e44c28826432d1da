"""Async-vs-sync benchmark: the SAME job (model, data, seed, resources, trained samples) run synchronously
(buffer.max_staleness 0) and asynchronously (max_staleness 1, 2, 4) side by side in one invocation, plus the
two pipeline bounds (generators alone, trainer alone), plus a learning-equivalence check.

Every job is a real `slipstream.job.local.run_job`: managed Redis, local Ray, engine, rollout worker(s),
trainer, weight bus. Only buffer.max_staleness differs between the throughput jobs (and the job name /
output directory). max_staleness 0 is synchronous on-policy RL: the buffer's admission control lets the
fleet start only the groups of the current step, so the generators idle while the trainer trains and
publishes, and the trainer idles while the generators generate.

Rates (each throughput job runs `warmup + steps` optimizer steps; the first `warmup` are excluded: Ray and
model start, first batch, allocator warm-up):
- samples/s = steps * groups_per_step * group_size / (elapsed_s[last] - elapsed_s[warmup]), the trainer's
  own clock from its progress records (trained samples per second, end to end); tokens/s the same with the
  records' response_tokens.
- trainer busy fraction = sum(step_s) / window (forward/backward/optimizer; the records' wait_s is time
  spent waiting for a batch, publish_s the weight transfer: both reported too, as fractions).
- generator busy fraction = share of the window's samples, taken every `--sample-interval-s` from the
  engine's Prometheus metrics (sglang:num_running_reqs minus sglang:num_paused_reqs > 0), in which the
  engine had a request decoding; generator utilisation = the engine's generated tokens/s in the window
  (sglang:generation_tokens) / its generated tokens/s in the generator-only phase. The window in wall time
  runs from the arrival of step `warmup`'s progress record to the last one's (the records stream through
  Redis as each step commits).
- staleness distribution: the buffer's histogram of consumed groups (versions), whole job.

Pipeline bounds, measured in one more session on the same stack (the job's stages run alone:
slipstream.job.generators.generators_only, then slipstream.job.trainers.trainer_only; unbounded admission:
max_staleness 10^6, so nothing ever waits on the trainer):
- generator-only: the engine and rollout worker(s) with no trainer consuming fill the buffer; rate =
  groups produced between the `warmup`-th and the `(warmup + steps)`-th step's worth of groups / time.
- trainer-only: then the trainer (publishing to the engine every step as in a job) trains `warmup + steps`
  steps on the pre-filled buffer (no wait for data); rate as for the jobs.

Headlines (benchmarks/README.md): ratios.async_vs_sync = samples/s at max_staleness 2 / at 0 (which one is
`config.async_vs_sync_uses`; the best async one is ratios.best_async_vs_sync); ratios.async_vs_pipeline_bound
= the same async samples/s / min(generator-only, trainer-only).

Learning equivalence (part of the default run; `--no-learning` skips it, `--learning-only` runs only it):
the demo's a+b job on the tiny SFT-warmed `tiny-arith` model on either device (on cuda through the same
stack as the throughput jobs: external bf16 engine, CUDA trainer; `--learning-model job` uses the
throughput job instead, which on cuda has random weights and nothing to learn), `--learning-seeds`
seeds (algorithm.seed and dataset.seed), three jobs per seed: sync (max_staleness 0, decoupled_ppo),
async (max_staleness 2, decoupled_ppo) and async without the importance correction (max_staleness 2,
`ppo`: PPO-clip with the ratio pi/pi_behav, i.e. the behaviour policy is the clipping anchor, no proximal policy and no truncated IS weight; see trainer/losses.py).
Reported: final-window reward (mean training-batch reward of the last `--learning-window` steps) per seed,
and whether the async mean lies within the seed spread of sync (see `learning.definition` in the JSON).

Devices:
- cpu (default): the `tiny-arith` demo model (examples/demo.yaml: a+b, 6 new tokens), built once and
  reused; built-in engine and trainer, 1 torch thread each, share the box's cores.
- cuda: trainer on GPU `--trainer-gpu` (Ray gives it one GPU), one built-in engine on `--engine-gpu`
  started by this script as an `external` engine (the job's built-in engine actor does not take a device
  today, see the report), NCCL weight bus; model: Qwen2.5-0.5B shape with random weights and the
  `tiny-tools` ChatML tokenizer (vocabulary cut to it, so that a random model's EOS comes at varied
  lengths), multi-turn word problems with the calculator (examples/tools_demo.yaml).

Run:
    python -m benchmarks.async_vs_sync                  # CPU, full: ~11 min of jobs on 2 cores + the tiny model's
                                                        # SFT build (1-8 min, by host load)
    python -m benchmarks.async_vs_sync --quick          # CPU smoke (the test)
    python -m benchmarks.async_vs_sync --device cuda --device-kind nvidia-h200-x2
    # learning equivalence alone on one GPU (trainer and engine share it; gloo bus through host memory):
    python -m benchmarks.async_vs_sync --device cuda --learning-only --engine-gpu 0 --trainer-gpu 0 \
        --bus-backend gloo --device-kind nvidia-h100-x1

Length bias (`--length-bias`, its own result file `async_vs_sync-<device>-lengths-<date>.json`): the
response lengths trained vs generated under each admission rule (sync, `buffer.admission: version`,
`buffer.admission: oldest`, `version` with `buffer.stale_policy: keep`), with two-sample KS statistics; benchmarks/async_vs_sync/lengths.py.

fp32 LM heads (`--fp32-lm-head both`, its own result file `async_vs_sync-<device>-fp32-head-<date>.json`):
each --staleness job without and with the fp32 LM head on engine and trainer, the train/infer mismatch
(mean |trainer - engine| logprob, k3 KL(behaviour || trainer)) and samples/s side by side, ratios
fp32 / bf16; on cuda the a+b job on the tiny-arith model by default (`--fp32-head-model job`: the
throughput job); benchmarks/async_vs_sync/fp32_head.py. `--fp32-lm-head on` runs every job with them.

Modules: job (the job, its model, the external engine), measure (one job run and its rates, the engine
sampler), pipeline (the two bounds), learning (learning equivalence, merging runs), lengths (length bias),
fp32_head (fp32 LM heads), plots, cli.
"""

from benchmarks.async_vs_sync.cli import main, parse_args, report, run, summarise
from benchmarks.async_vs_sync.job import (
    base_spec,
    build_cuda_model,
    build_tiny_arith,
    env_info,
    make_spec,
    step_samples,
)
from benchmarks.async_vs_sync.learning import learning_job, learning_summary, merge_learning
from benchmarks.async_vs_sync.measure import rates, slim

__all__ = [
    "base_spec",
    "build_cuda_model",
    "build_tiny_arith",
    "env_info",
    "learning_job",
    "learning_summary",
    "main",
    "make_spec",
    "merge_learning",
    "parse_args",
    "rates",
    "report",
    "run",
    "slim",
    "step_samples",
    "summarise",
]
