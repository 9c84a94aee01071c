"""`--api-keys-file`: API keys -> tenants, each with the models it may use, its limits, priority and SLOs.

```yaml
tenants:
  - name: team-a
    keys: ["sk-team-a-1", "sha256:<hex of a key>"]
    models: ["*"]                     # served model / adapter names, globs
    limits: {requests_per_minute: 60, tokens_per_minute: 20000, concurrent: 8, tokens_per_day: 2000000}
    priority: 0                       # lower runs first, as vLLM's `priority`
    slo: {ttft_ms: 1000, tpot_ms: 100}
    cache_group: team-a               # tenants share prefix-cache blocks only within one group (default: its name)
    adapters: ["team-a-*"]            # LoRA adapters this tenant owns: no other tenant may use them
```

The same shape as JSON works. Keys are kept only as SHA-256 digests (a key written as `sha256:<hex>` is one
already) and a presented key is compared with every digest in constant time, so neither the file's keys nor the
response time say how much of a wrong key matched. A bad file is refused whole with the reason: at start-up the
server does not start, on reload the old table stays.
"""
from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import hmac
import json
import logging
import signal
import threading
from dataclasses import asdict, dataclass, field, fields, replace

from tokenmill.core.request import RequestSLO

log = logging.getLogger("tokenmill.serve")


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    models: tuple[str, ...] = ("*",)
    limits: TenantLimits = field(default_factory=TenantLimits)
    priority: int = 0
    slo: RequestSLO = field(default_factory=RequestSLO)  # its requests' targets (the slo scheduling policy)
    # The prefix-cache salt: tenants share cached blocks only within one group (serve/tenants/isolation.py).
    cache_group: str | None = None
    adapters: tuple[str, ...] = ()  # globs of the adapter names it owns
    others_adapters: tuple[str, ...] = ()  # globs other tenants own: never usable by this one

    def may_use(self, model: str) -> bool:
        if any(fnmatch.fnmatchcase(model, p) for p in self.others_adapters) and \
                not any(fnmatch.fnmatchcase(model, p) for p in self.adapters):
            return False  # another tenant's adapter, whatever this tenant's `models` globs say
        return any(fnmatch.fnmatchcase(model, p) for p in self.models + self.adapters)

    @property
    def salt_group(self) -> str:
        return self.cache_group or self.name


def tenant_of(scope) -> Tenant | None:
    """The tenant the auth middleware found for this request (None: no keys file, an open route, the admin)."""
    return scope.get("state", {}).get("tenant")


def priority_for(tenant: Tenant | None, requested: int) -> int:
    """A tenant's priority class is the most urgent its requests get (lower runs first): a request may ask to
    run later than its class, never sooner."""
    return requested if tenant is None else max(requested, tenant.priority)


def request_slo(field, min_ttft_ms: float = 0.0) -> RequestSLO | None:
    """The request's `slo` field (protocol.SLOField) as a RequestSLO; ValueError for a non-positive target.
    A TTFT target below `min_ttft_ms` (--min-slo-ttft-ms) is a 400 naming `slo.ttft_ms`, not clamped: no step can
    meet it, and the caller should know its target is not what it asked for. (A target that tight would shorten
    every step of everyone's batch work for nothing.)"""
    if field is None:
        return None
    if field.ttft_ms is not None and field.ttft_ms < min_ttft_ms:
        from tokenmill.serve.errors import APIError

        raise APIError(400, f"slo.ttft_ms must be at least {min_ttft_ms:g} ms on this server (--min-slo-ttft-ms), "
                            f"got {field.ttft_ms:g}.", "slo.ttft_ms", "slo_below_floor")
    return RequestSLO(field.ttft_ms, field.tpot_ms)


def slo_for(tenant: Tenant | None, requested: RequestSLO | None) -> RequestSLO | None:
    """The latency targets a request runs with. Without tenants, what it asks for. With one, its tenant's: a
    request may relax a target (ask for a later one), never tighten it, and a tenant without targets runs
    batch work whatever its requests ask."""
    if tenant is None:
        return requested if requested is not None and not requested.empty else None
    own = tenant.slo
    if own.empty:
        return None
    if requested is None:
        return own

    def later(mine: float | None, asked: float | None) -> float | None:
        return None if mine is None else max(mine, asked) if asked is not None else mine

    return RequestSLO(later(own.ttft_ms, requested.ttft_ms), later(own.tpot_ms, requested.tpot_ms))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass
class KeyTable:
    entries: list[tuple[bytes, Tenant]]  # (SHA-256 of a key, its tenant)
    tenants: dict[str, Tenant]

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of `key`, comparing its digest with every entry in constant time."""
        d = digest(key)
        found = None
        for entry, tenant in self.entries:
            if hmac.compare_digest(entry, d) and found is None:
                found = tenant
        return found


def parse_json_or_yaml(text: str, path: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        import yaml
    except ImportError:
        raise KeysFileError(f"{path}: not JSON, and PyYAML is not installed to read YAML.") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KeysFileError(f"{path}: neither JSON nor YAML ({e}).") from None


def _section(d, cls, where: str, path: str):
    if d is None:
        return cls()
    if not isinstance(d, dict):
        raise KeysFileError(f"{path}: {where} must be a mapping.")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise KeysFileError(f"{path}: {where} has unknown keys {unknown}; known: {sorted(names)}.")
    for k, v in d.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise KeysFileError(f"{path}: {where}.{k} must be a positive number, got {v!r}.")
    return cls(**d)


def load_keys(path: str) -> KeyTable:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise KeysFileError(f"{path}: cannot be read ({e.strerror}).") from None
    doc = parse_json_or_yaml(text, path)
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list) or not doc["tenants"]:
        raise KeysFileError(f"{path}: needs a non-empty list `tenants`.")
    entries: list[tuple[bytes, Tenant]] = []
    tenants: dict[str, Tenant] = {}
    seen: set[bytes] = set()
    for i, t in enumerate(doc["tenants"]):
        where = f"tenants[{i}]"
        if not isinstance(t, dict):
            raise KeysFileError(f"{path}: {where} must be a mapping.")
        unknown = sorted(set(t) - {"name", "keys", "models", "limits", "priority", "slo", "cache_group",
                                   "adapters"})
        if unknown:
            raise KeysFileError(f"{path}: {where} has unknown keys {unknown}.")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise KeysFileError(f"{path}: {where} needs a name.")
        if name in tenants:
            raise KeysFileError(f"{path}: tenant {name!r} is given twice.")
        keys = t.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise KeysFileError(f"{path}: tenant {name!r} needs a non-empty list of keys.")
        models = t.get("models", ["*"])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise KeysFileError(f"{path}: tenant {name!r}: models must be a list of names or globs.")
        priority = t.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise KeysFileError(f"{path}: tenant {name!r}: priority must be an integer.")
        limits = _section(t.get("limits"), TenantLimits, f"tenant {name!r} limits", path)
        for k, v in asdict(limits).items():
            if v is not None and not isinstance(v, int):
                raise KeysFileError(f"{path}: tenant {name!r} limits.{k} must be an integer, got {v!r}.")
        cache_group = t.get("cache_group")
        if cache_group is not None and (not isinstance(cache_group, str) or not cache_group):
            raise KeysFileError(f"{path}: tenant {name!r}: cache_group must be a non-empty string.")
        adapters = t.get("adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
            raise KeysFileError(f"{path}: tenant {name!r}: adapters must be a list of names or globs.")
        tenant = Tenant(name, tuple(models), limits, priority,
                        _section(t.get("slo"), RequestSLO, f"tenant {name!r} slo", path), cache_group,
                        tuple(adapters))
        tenants[name] = tenant
        for key in keys:
            if key.startswith("sha256:"):
                try:
                    d = bytes.fromhex(key[len("sha256:"):])
                except ValueError:
                    d = b""
                if len(d) != 32:
                    raise KeysFileError(f"{path}: tenant {name!r} has a sha256: key that is not 64 hex digits.")
            else:
                d = digest(key)
            if d in seen:
                raise KeysFileError(f"{path}: a key of tenant {name!r} is given twice (keys must be unique).")
            seen.add(d)
            entries.append((d, tenant))
    return _with_ownership(KeyTable(entries, tenants))


def _with_ownership(table: KeyTable) -> KeyTable:
    """Each tenant learns the adapter globs the others own (Tenant.others_adapters), so `may_use` alone keeps
    another team's adapters from it — in the server and in the router alike."""
    owned = {name: t.adapters for name, t in table.tenants.items()}
    tenants = {name: replace(t, others_adapters=tuple(g for other, gs in owned.items() if other != name for g in gs))
               for name, t in table.tenants.items()}
    return KeyTable([(d, tenants[t.name]) for d, t in table.entries], tenants)


class KeyStore:
    """The current key table, swapped whole on reload (requests in flight keep the tenant they started with)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.table = load_keys(path)

    def reload(self) -> KeyTable:
        table = load_keys(self.path)  # raises before anything changes
        with self._lock:
            self.table = table
        return table

    def lookup(self, key: str) -> Tenant | None:
        return self.table.lookup(key)


def reload_keys(keys: KeyStore) -> list[str]:
    """Re-read the keys file (POST /admin/reload, SIGHUP) and name its tenants; KeysFileError keeps the old table."""
    table = keys.reload()
    log.info("API keys reloaded from %s: %d tenant(s)", keys.path, len(table.tenants))
    return sorted(table.tenants)


def reload_on_sighup(keys: KeyStore) -> None:
    """SIGHUP re-reads the keys file (a bad file keeps the old table, logged); requests in flight go on. Call it
    from the event loop (the server's and the router's lifespan)."""

    def reload() -> None:
        try:
            reload_keys(keys)
        except ValueError as e:
            log.error("API keys not reloaded, the old ones stay: %s", e)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, AttributeError, ValueError):  # no SIGHUP, or not the main thread
        log.warning("SIGHUP cannot reload the API keys here; use POST /admin/reload")
