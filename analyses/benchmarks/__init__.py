"""Timing and memory benchmarks of the loop, the probes and the TRL integration (bench_*),
the profile of a probed optimizer step (profile_probes) and the GPU recipe's smoke run
(gpu_smoke.py, driven by gpu_smoke.sh). They print tables (some also write one into a page);
timings are measurements on the machine at hand, never pass/fail checks.
"""
