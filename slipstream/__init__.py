"""The control plane users touch: the `slipstream` command (`cli/`), a job's runtime on Ray (`job/`:
the driver, its generator and trainer pools, supervision, progress, tracking) and the cluster (`cluster/`:
the control API, the job store, Redis and Ray services, Prometheus targets, the status page).

May import: every other package (it is the top floor).
"""
