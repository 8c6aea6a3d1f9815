"""One way for every part to open Redis: a single server or a Redis Cluster, picked from the URL.

    redis://host:port/db, rediss://...        one Redis server (redis.asyncio.Redis)
    redis+cluster://host:port[/0], rediss+cluster://...   a Redis Cluster (redis.asyncio.RedisCluster);
                                              one reachable node is enough, the client finds the rest

Both clients answer the same calls the parts use: commands on one key (or on keys of one hash
slot), scripts whose keys share a slot, and non-transactional pipelines, which the cluster client
splits per node. Key names and their hash tags live in common/redis_keys.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SCHEMES = {"redis", "rediss", "unix", *CLUSTER_SCHEMES}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def check_url(url: str) -> str:
    """`url` if Redis can be reached by it; else a ValueError that says what is accepted."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(
            f"{url!r} is not a Redis URL: use redis://host:port/db for one server or "
            "redis+cluster://host:port for a Redis Cluster (rediss:// and rediss+cluster:// with TLS)"
        )
    if scheme in CLUSTER_SCHEMES and urlsplit(url).path not in ("", "/", "/0"):
        raise ValueError(f"{url!r}: a Redis Cluster has only database 0")
    return url


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for logs and banners."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _plain(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme], path=""))


def connect(url: str, timeout: float = 1.0, **kwargs):
    """An asyncio client for `url` whose every call is bounded by `timeout` seconds."""
    check_url(url)
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **kwargs}
    if is_cluster_url(url):
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster.from_url(_plain(url), **options)
        # SlotPipelines opens one plain connection per node with the same options.
        client.kvharbor_node_options = {k: v for k, v in options.items() if k != "decode_responses"} | {
            "decode_responses": options.get("decode_responses", False),
            "ssl": urlsplit(url).scheme == "rediss+cluster",
            "username": urlsplit(url).username,
            "password": urlsplit(url).password,
        }
        return client
    import redis.asyncio as redis

    return redis.from_url(url, **options)


def connect_sync(url: str, timeout: float = 1.0, **kwargs):
    """The blocking client for `url` (tests, benchmarks, start-up checks)."""
    check_url(url)
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **kwargs}
    if is_cluster_url(url):
        import redis

        return redis.RedisCluster.from_url(_plain(url), **options)
    import redis

    return redis.Redis.from_url(url, **options)


def is_cluster_client(client) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


@dataclass(frozen=True)
class Script:
    """A Lua script run by SHA (EVALSHA), loaded on the node that first lacks it."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True)
class Call:
    """One command for SlotPipelines. `key` routes it: every key the command touches shares this
    key's hash slot. For a script, `keys` are its KEYS and `args` its ARGV; otherwise `args` is
    the whole command, e.g. ("HMGET", key, field, ...)."""

    key: str
    args: tuple
    script: Script | None = None
    keys: tuple = ()

    def command(self) -> tuple:
        if self.script is None:
            return self.args
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)


class SlotPipelines:
    """Many commands on keys of many hash slots, sent as one pipeline per node, the nodes in
    parallel; answers in the order of the calls. On a single Redis that is one pipeline.

    redis-py's cluster pipeline refuses scripts, and a script over keys of several slots is not
    allowed in a cluster, so work that spans slots is split here, client-side, into one script
    call per slot group. A node that moved a slot (MOVED/ASK) makes the topology be read again
    and the call retried once; a node that does not know a script gets it loaded, then the call
    runs. Any other failure raises (a redis.exceptions error): callers decide what an outage means.
    Replies are raw RESP values (lists, not redis-py's parsed dicts): read them with `pairs`."""

    def __init__(self, client) -> None:
        self.client = client
        self.cluster = is_cluster_client(client)
        self._nodes: dict[str, object] = {}
        self._loaded: dict[int, set[str]] = {}  # id(node client) -> scripts it was given

    async def run(self, calls: Sequence[Call], raise_on_error: bool = True) -> list:
        """Results in call order. `raise_on_error=False`: a command's error reply comes back in
        its place (a node that cannot be reached still raises)."""
        if not calls:
            return []
        if not self.cluster:
            return await self._run_on(self.client, list(calls), raise_on_error)
        await self.client.initialize()
        groups: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(self._node_for(call.key), []).append(i)
        results: list = [None] * len(calls)
        replies = await asyncio.gather(
            *(self._run_on(self._nodes[name], [calls[i] for i in idx], raise_on_error) for name, idx in groups.items()),
            return_exceptions=True,
        )
        moved: list[int] = []
        for idx, reply in zip(groups.values(), replies, strict=True):
            if isinstance(reply, _Moved):
                moved += idx
                continue
            if isinstance(reply, BaseException):
                raise reply
            for i, value in zip(idx, reply, strict=True):
                results[i] = value
        if moved:
            await self.client.nodes_manager.initialize()  # the slots moved: read the map again
            for i, value in zip(moved, await self.run([calls[i] for i in moved], raise_on_error), strict=True):
                results[i] = value
        return results

    def _node_for(self, key: str) -> str:
        import redis.asyncio as redis

        node = self.client.get_node_from_key(key)
        if node.name not in self._nodes:
            options = getattr(self.client, "kvharbor_node_options", {})
            self._nodes[node.name] = redis.Redis(host=node.host, port=node.port, **options)
        return node.name

    async def _run_on(self, client, calls: list[Call], raise_on_error: bool = True) -> list:
        from redis.exceptions import NoScriptError, ResponseError

        # Load scripts first, so a pipeline's calls run in their order (a NOSCRIPT retry would
        # run the script after the calls behind it).
        loaded = self._loaded.setdefault(id(client), set())
        for script in {call.script for call in calls if call.script is not None and call.script.sha not in loaded}:
            await client.script_load(script.source)
            loaded.add(script.sha)
        replies = await self._pipeline(client, calls)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:  # the node restarted and forgot them
            for script in {calls[i].script for i in missing}:
                await client.script_load(script.source)
            for i, reply in zip(missing, await self._pipeline(client, [calls[i] for i in missing]), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, ResponseError) and str(reply).startswith(("MOVED", "ASK")):
                raise _Moved(str(reply))
            if isinstance(reply, BaseException) and raise_on_error:
                raise reply
        return replies

    @staticmethod
    async def _pipeline(client, calls: list[Call]) -> list:
        """One round trip on one connection. Commands are packed by hiredis (C) and replies come
        back raw (no redis-py response callbacks): packing in Python cost more than the
        intake's own work. Without hiredis, redis-py's pipeline does the same, slower."""
        try:
            import hiredis
        except ImportError:
            pipe = client.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command(*call.command())
            return list(await pipe.execute(raise_on_error=False))
        from redis.exceptions import ResponseError

        pool = client.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(b"".join(hiredis.pack_command(call.command()) for call in calls))
            replies: list = []
            for _ in calls:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # this command's error; the connection is still in step
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect()  # a reply may still be in flight: this connection is out of step
            raise
        finally:
            await pool.release(conn)

    async def close(self) -> None:
        for client in self._nodes.values():
            await client.aclose()
        self._nodes.clear()


class _Moved(Exception):
    """A node answered MOVED/ASK: the slot map this client holds is out of date."""


def pairs(reply) -> dict:
    """A raw map reply as a dict: RESP3 sends a map, RESP2 a flat [k1, v1, k2, v2, ...] list."""
    if isinstance(reply, dict):
        return reply
    items = iter(reply or ())
    return dict(zip(items, items, strict=True))


class RedisAuthError(ValueError):
    """Redis answered, and refused our credentials: no retry will help, so the part stops."""


def check_credentials(url: str, timeout: float = 3.0) -> None:
    """At start-up: RedisAuthError, with what to do, when Redis refuses the URL's user or
    password (or asks for one the URL lacks). Redis that does not answer is not an error here:
    every part starts without Redis and catches up when it comes."""
    from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError

    client = None
    try:
        client = connect_sync(url, timeout=timeout)
        client.ping()
    except AuthenticationError as exc:
        raise RedisAuthError(_auth_advice(url, exc)) from None
    except ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise RedisAuthError(_auth_advice(url, exc)) from None
    except (RedisError, RedisClusterException, OSError):
        pass  # not reachable now: the part starts anyway and retries
    finally:
        if client is not None:
            client.close()


def credentials_refused(url: str | None, prog: str) -> bool:
    """A part's start-up check (`check_credentials`) of its Redis URL, if it has one: True, having
    said why and what to do on stderr, when Redis refuses the credentials; the part then exits 2
    instead of retrying a password that can never work."""
    if not url:
        return False
    try:
        check_credentials(url)
    except RedisAuthError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return True
    return False


def _auth_advice(url: str, exc: Exception) -> str:
    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or 6379}"
    given = "no password" if not parts.password else f"user {parts.username or 'default'!r} and a password"
    return (
        f"Redis at {where} refused the credentials ({given}): {exc}. Put the right ones in the URL, "
        "redis://USER:PASSWORD@host:port/0 (or rediss:// for TLS); in the chart, the Secret it names"
    )
