"""`mmserve bench`: the serving benchmark client and the component benchmark runner.

- `datasets.py`, `dataset_files.py`: the requests to send (`random-mm`, `jsonl`, `image-dir`).
- `client.py`: one streamed chat completion over HTTP, timed (TTFT, inter-token gaps).
- `runner.py`: one run of a workload (Poisson arrivals, a concurrency cap, a progress bar),
  with the server's /metrics scraped before and after (`prometheus.py`).
- `report.py`: a run's figures under stable names, the terminal table and the JSON file;
  `plot.py` draws them.
- `launch.py`: `--launch`, a server started and stopped by the benchmark.
- `serve.py`: `mmserve bench serve`; `components.py`: `mmserve bench components`;
  `cli.py`: both commands' flags.

Nothing here imports torch: the client runs wherever the server is reachable.
"""
