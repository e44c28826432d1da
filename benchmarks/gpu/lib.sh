# Shared by the GPU phase scripts (sourced): NCCL without NVLink multicast (the lent machines' setting),
# and `step NAME LIMIT CMD...`, which runs one step under its own timeout, logging to $LOG.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "== $name rc=$? ($(date +%T))" | tee -a "$LOG"
}
