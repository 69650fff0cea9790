"""`mode=check`: the combination judged for the deployment's device; nothing allocated."""
from __future__ import annotations

from dsv4.app.job import Job, memory_line, problems_for, raise_if


def check_mode(job: Job, *, multirun: bool) -> None:
    raise_if(job, problems_for(job, running=False))
    heads = job.spec.num_attention_heads // job.combo.tp_size
    print(f"OK: model={job.spec.name} on {job.device.describe()}, tp_size={job.combo.tp_size}, "
          f"{heads} heads per rank padded to {job.combo.head_padding.padded_heads(heads)}")
    print("  " + " ".join(f"{k}={v}" for k, v in job.choices.items()))
    print("  " + memory_line(job, running=False))
