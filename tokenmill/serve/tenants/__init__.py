"""Tenants of a server (docs/tenants.md): who a request's key belongs to (`keys.py`: `--api-keys-file`, reloaded on
SIGHUP or `POST /admin/reload`), which models it may use, its priority class, and its rate limits (`limits.py`:
concurrent requests and requests per minute, checked before a request's body is read)."""
