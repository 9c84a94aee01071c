"""`tokenmill router`: one OpenAI-compatible endpoint in front of several servers, choosing a backend per
request by policy (round-robin, least-load, or prefix-aware on the backends' reported KV caches)."""
from tokenmill.router.policies import POLICIES, LeastLoad, Policy, PrefixAware, RoundRobin, make_policy

__all__ = ["POLICIES", "LeastLoad", "Policy", "PrefixAware", "RoundRobin", "make_policy"]
