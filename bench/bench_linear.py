"""The dense projections (`linear`) alone: every option this machine runs on the layer's products at
several row counts, bf16 first, DeepGEMM and ours beside it in one process (mode=bench's table).

  python bench/bench_linear.py                               # DSV4-Flash on the H200
  python bench/bench_linear.py --rows 1 16 64 model=dsv4_pro
"""
from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir

from dsv4.speed.gpu import require_gpu
from dsv4.speed.kernels import bench_linear
from dsv4.checks.catalogue import config_dir
from dsv4.app.job import make_job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 64, 128, 8192])
    ap.add_argument("overrides", nargs="*", default=["deployment=h200"])
    a = ap.parse_args()
    require_gpu("bench/bench_linear.py")
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        job = make_job(compose(config_name="config", overrides=a.overrides or ["deployment=h200"]))
    print(f"model={job.spec.name}, tp_size={job.combo.tp_size}:\n" + bench_linear(job, tuple(a.rows)))


if __name__ == "__main__":
    main()
