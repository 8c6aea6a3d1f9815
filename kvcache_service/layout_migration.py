"""The KV index's key layout across upgrades, run by the intake (kvcache_service/consumer.py).

Redis holds the name of the layout the index was written in (`P layout`). A replica names its own
before it applies anything (`claim`): when Redis held an index in another layout, what it indexed
is unreadable here, and only the engines can say again what they hold, so the intake asks them to
re-sync. The older layout's block shard keys (never read again) are marked (`P layout:old`), and
the intake's leader removes them a few SCAN calls a sweep (`sweep`): bounded, so intake stays on
time. A pass over every node that removed nothing clears the mark (replicas of the older build may
still write some during a rolling upgrade). A failure drops the pass; the next sweep, or the next
leader, starts over.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvharbor.common.redis_client import Call

log = logging.getLogger("kvharbor.kvcache.layout")

# The block shards' key layout, kept in `P layout` and named in the shard keys (`:b2`). Bumped
# when it changes (2: the raw 2-byte bucket suffix; 1, unnamed, `:b`: a decimal of 32,768): blocks
# written in another layout are not where this build reads them.
LAYOUT = "2"
# Layout 1's block shard keys (`:b:` then a decimal bucket, or `m` for the marker).
_LAYOUT_1_KEY = re.compile(rb"\{[^{}]*:[a-z]\d\d\}:b:(?:\d+|m)")
# The leader's removal of an older index layout's keys (~600k at 10M entries): SCAN calls of this
# COUNT, this many a sweep (every 2 s), each page's old keys UNLINKed.
OLD_SCAN_PAGE = 1000
OLD_PAGES_PER_SWEEP = 4


class LayoutMigration:
    """The layout of `index` (a RedisIndex): claimed once per replica, old keys swept by the leader."""

    def __init__(self, index: Any) -> None:
        self.index = index
        self.removed_total = 0  # keys of an older layout this replica removed
        self._pages: AsyncIterator[list[bytes]] | None = None  # the pass over an older layout's keys
        self._pass_removed = 0

    # -- Redis --------------------------------------------------------------------------------

    async def claim(self) -> bool:
        """Record this build's layout; True when Redis held an index in another one (or in none
        named: written before layouts were). A Redis with no layout and no instance yet is new,
        not old: False."""
        index = self.index
        key, registered = index.global_key("layout"), index.global_key("instances")
        found, instances = await index.run([Call(key, ("GET", key)), Call(registered, ("HLEN", registered))])
        if found == LAYOUT.encode():
            return False
        older = found is not None or int(instances) > 0
        if older:  # marked before the layout moves, so no crash in between can leave its keys unmarked
            old_key = index.global_key("layout:old")
            await index.run([Call(old_key, ("SET", old_key, found or b"1"))])
        (swapped,) = await index.run([Call(key, ("SET", key, LAYOUT, "GET"))])
        return older and swapped != LAYOUT.encode()  # one replica of several starting at once

    async def left(self) -> bool:
        """Whether keys of an older layout may remain (the mark `claim` set is there)."""
        key = self.index.global_key("layout:old")
        (found,) = await self.index.run([Call(key, ("EXISTS", key))])
        return bool(int(found))

    async def pages(self, page: int = OLD_SCAN_PAGE) -> AsyncIterator[list[bytes]]:
        """The block shard keys of layout 1, one SCAN call (COUNT `page`) at a time on each node in
        turn, so a caller bounds its work in calls, not in keys found (the block store shares the
        keyspace: old keys may be sparse). Each is checked against the old key's form, so no other
        key can be taken for one. A page may be empty."""
        index = self.index
        prefix, pattern, client = index.prefix.encode(), index.prefix + "{*}:b:*", index.client
        for node in client.get_primaries() if index.cluster else [None]:
            cursor = 0
            while True:
                if node is None:
                    cursor, keys = await client.scan(cursor=cursor, match=pattern, count=page)
                else:
                    cursors, keys = await client.scan(cursor=cursor, match=pattern, count=page, target_nodes=node)
                    cursor = cursors[node.name]
                yield [k for k in keys if k.startswith(prefix) and _LAYOUT_1_KEY.fullmatch(k, len(prefix))]
                if not cursor:
                    break

    async def unlink(self, keys: Sequence[bytes]) -> int:
        """UNLINK `keys`; how many there were (SCAN may return a key twice)."""
        calls = [Call(k.decode("utf-8", "replace"), ("UNLINK", k)) for k in keys]
        return sum(int(n) for n in await self.index.run(calls))

    async def unmark(self) -> None:
        key = self.index.global_key("layout:old")
        await self.index.run([Call(key, ("DEL", key))])

    # -- the leader's sweep ---------------------------------------------------------------------

    async def sweep(self) -> None:
        """A few SCAN calls of the older layout's keys (OLD_PAGES_PER_SWEEP of COUNT OLD_SCAN_PAGE),
        their keys removed. The mark is read each sweep while no pass runs."""
        if self._pages is None:
            if not await self.left():
                return
            self._pages, self._pass_removed = self.pages(OLD_SCAN_PAGE), 0
        try:
            for _ in range(OLD_PAGES_PER_SWEEP):
                try:
                    keys = await anext(self._pages)
                except StopAsyncIteration:
                    await self._pass_ended()
                    return
                if keys:
                    removed = await self.unlink(keys)
                    self._pass_removed += removed
                    self.removed_total += removed
        except BaseException:
            await self.drop_pass()
            raise

    async def _pass_ended(self) -> None:
        self._pages = None
        if not self._pass_removed:
            await self.unmark()
            log.info("the older index layout's keys are gone", extra={"removed": self.removed_total})

    async def drop_pass(self) -> None:
        pages, self._pages = self._pages, None
        if pages is not None:
            with contextlib.suppress(Exception):
                await pages.aclose()
