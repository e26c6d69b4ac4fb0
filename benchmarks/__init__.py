"""Speed benchmarks, measured side by side in one run: the batched env against gymnasium's and
Stable-Baselines3's vector envs, our PPO and SAC against Stable-Baselines3's, and the speed switches.

Run them with ``doit bench`` or as modules (``python -m benchmarks.env_throughput --help``); results go to
``outputs/bench/*.parquet`` and ``outputs/bench/benchmarks.md``.
"""
