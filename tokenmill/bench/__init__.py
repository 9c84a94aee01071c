"""`tokenmill bench`: load-test any OpenAI-compatible server and report what it did.

This package talks to servers over HTTP only; it never imports the engine, so it measures tokenmill
exactly as it measures any other server.

- `datasets`: prompts made locally from a seed, or read from a JSONL / ShareGPT file
- `sse`: Server-Sent Events parsing
- `client`: the async load generator (arrivals, concurrency, per-request timings)
- `metrics`: pure functions from per-request records to the summary (percentiles, goodput, cost)
- `prometheus`: the server's `/metrics` before and after a run (prefix-cache hits, preemptions)
- `report`: the result JSON, its schema, the text summary and `compare`
- `html_report`: the self-contained HTML page with plots
- `serve_bench`: the `bench serve` / `bench compare` command line
"""
