"""The informers behind the watch caches (operator/tilert_operator/cache.py), against the API test
server: a watch the server ends is resumed from the bookmark's resourceVersion without a list; a
410 Gone lists again and reports what vanished in the gap; a read right after a write sees the
write, and an older watch event does not take it back; an optional kind the server does not serve
answers 404 from the cache without a call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pdc_harness as h
import pytest

from tilert_operator import constants
from tilert_operator.cache import SELECTOR, Cache, CacheSettings, Informer, selector_matcher
from tilert_operator.kubeapi import ApiError, Client, Connection

CM = ("", "v1", "configmaps")
SECRET = ("", "v1", "secrets")
Event = tuple[str, str | None, str]


async def until(what: str, fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def cm(name: str, cluster: str = "c", data: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default", "labels": {constants.LABEL_CLUSTER: cluster}},
        "data": {"k": data},
    }


def names(informer: Informer) -> set[str]:
    return set(informer.store)


async def test_bookmarks_resume_the_watch_and_a_410_relists_reporting_the_gap(apiserver: Any) -> None:
    srv = apiserver.server
    apiserver.call(srv.put(CM, cm("a")))
    apiserver.call(srv.put(CM, cm("b")))
    seen: list[Event] = []
    async with Client(Connection(server=apiserver.url)) as api:
        cache = Cache(
            api,
            lambda kind, t, o: seen.append((kind, t, o["metadata"]["name"])),
            CacheSettings(watch_timeout_s=1.0),
        )
        cache.attach("default", "c")
        try:
            assert await cache.wait_synced("default", 20)
            informer = cache.informer("ConfigMap", "default")
            assert informer is not None
            assert {"a", "b"} <= names(informer)
            assert ("ConfigMap", None, "a") in seen  # the initial list

            # Bookmarks: another kind changes, the ConfigMaps' watch ends (timeoutSeconds) with a
            # bookmark at the newer resourceVersion, and resumes from it without a list.
            apiserver.call(
                srv.put(
                    SECRET,
                    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "default"}},
                )
            )
            target = str(srv.rv)
            await until("a resumed watch", lambda: informer.watches >= 2)
            await until("the bookmark's resourceVersion", lambda: informer.resource_version == target)
            assert informer.lists == 1 and informer.relists == 0

            # A change comes through the resumed watch.
            apiserver.call(srv.put(CM, cm("c")))
            await until("c", lambda: "c" in informer.store)
            assert ("ConfigMap", "ADDED", "c") in seen

            # 410 Gone: "b" vanishes while no event reaches the watch (as in a gap between watches
            # whose events were compacted away); the relist replaces the store and reports it.
            def vanish() -> None:
                key = (CM, "default", "b")
                srv.store.pop(key)
                srv.by_res[CM].pop(key)

            apiserver.sync(vanish)
            apiserver.call(srv.compact())
            await until("the relist", lambda: informer.relists == 1 and informer.lists == 2)
            await until("b gone", lambda: "b" not in informer.store)
            assert ("ConfigMap", "DELETED", "b") in seen
            assert {"a", "c"} <= names(informer)
        finally:
            await cache.stop()


async def test_a_read_after_a_write_sees_the_write(apiserver: Any) -> None:
    srv = apiserver.server
    async with Client(Connection(server=apiserver.url)) as api:
        cache = Cache(api, lambda *_: None, CacheSettings(watch_timeout_s=60))
        api.cache = cache
        cache.attach("default", "c")
        try:
            assert await cache.wait_synced("default", 20)
            written = await api.apply(cm("x", data="2"))
            # No watch event needed: the cache holds what the apply answered.
            got = await api.get("ConfigMap", "default", "x")
            assert got is not None and got["data"] == {"k": "2"}
            assert got["metadata"]["resourceVersion"] == written["metadata"]["resourceVersion"]
            gets = srv.counts(constants.FIELD_MANAGER)[("get", "configmaps")]
            assert gets == 0, "answered from the cache"
            listed = await api.list("ConfigMap", "default", f"{constants.LABEL_CLUSTER}=c")
            assert [o["metadata"]["name"] for o in listed] == ["x"]
            assert srv.counts(constants.FIELD_MANAGER)[("list", "configmaps")] == 1  # the informer's

            # An older event (before our write) does not take the store back.
            informer = cache.informer("ConfigMap", "default")
            assert informer is not None
            stale = cm("x", data="1")
            stale["metadata"]["resourceVersion"] = str(int(written["metadata"]["resourceVersion"]) - 1)
            informer._apply({"type": "MODIFIED", "object": stale})
            assert informer.store["x"]["data"] == {"k": "2"}
            # Its own echo, and later changes, are taken.
            await until("the echo", lambda: "x" not in informer.pins)
            apiserver.call(srv.put(CM, cm("x", data="3")))
            await until("a later change", lambda: informer.store["x"]["data"] == {"k": "3"})

            # A delete: gone from reads at once.
            await api.delete("ConfigMap", "default", "x")
            assert await api.list("ConfigMap", "default", f"{constants.LABEL_CLUSTER}=c") == []
        finally:
            await cache.stop()


async def test_an_unserved_optional_kind_answers_404_without_a_call(apiserver: Any) -> None:
    srv = apiserver.server
    async with Client(Connection(server=apiserver.url)) as api:
        cache = Cache(api, lambda *_: None)
        api.cache = cache
        cache.attach("default", "c")
        try:
            assert await cache.wait_synced("default", 20)
            before = srv.counts(constants.FIELD_MANAGER)[("list", "multi-networkpolicies")]
            assert before == 1
            with pytest.raises(ApiError) as e:
                await api.list("MultiNetworkPolicy", "default", f"{constants.LABEL_CLUSTER}=c")
            assert e.value.status == 404
            assert srv.counts(constants.FIELD_MANAGER)[("list", "multi-networkpolicies")] == before
        finally:
            await cache.stop()

    # With the CRD served, a new operator's informer lists and watches it.
    h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)
    async with Client(Connection(server=apiserver.url)) as api:
        cache = Cache(api, lambda *_: None)
        cache.attach("default", "c")
        try:
            assert await cache.wait_synced("default", 20)
            informer = cache.informer("MultiNetworkPolicy", "default")
            assert informer is not None and informer.unserved is None
            await until("its watch", lambda: informer.watches == 1)
        finally:
            await cache.stop()


def test_selectors_the_cache_answers() -> None:
    obj = {"metadata": {"labels": {constants.LABEL_CLUSTER: "c", "x": "1"}}}
    match = selector_matcher(f"{constants.LABEL_CLUSTER}=c")
    assert match is not None and match(obj)
    match = selector_matcher(f"{constants.LABEL_CLUSTER}=c,x!=1")
    assert match is not None and not match(obj)
    match = selector_matcher(f"{constants.LABEL_CLUSTER}==c,!y")
    assert match is not None and match(obj)
    # Not about one cluster, or set-based: the API server answers those.
    assert selector_matcher("x=1") is None
    assert selector_matcher(f"{constants.LABEL_CLUSTER} in (c)") is None
    assert selector_matcher(SELECTOR) is None


async def test_a_pdcluster_recreated_at_once_keeps_its_namespace_cached(apiserver: Any) -> None:
    """Detaching the last user forgets the namespace at once: an attach right after (a PDCluster
    deleted and created again) gets informers of its own, which the old ones' stop does not touch."""
    async with Client(Connection(server=apiserver.url)) as api:
        cache = Cache(api, lambda *_: None)
        cache.attach("default", "c")
        try:
            assert await cache.wait_synced("default", 20)
            old = cache.informer("ConfigMap", "default")
            stopping = cache.detach("default", "c")
            assert stopping is not None and cache.informer("ConfigMap", "default") is None
            cache.attach("default", "c")
            await stopping
            new = cache.informer("ConfigMap", "default")
            assert new is not None and new is not old and old is not None
            assert old.task is not None and old.task.done()
            assert await cache.wait_synced("default", 20)
            assert new.task is not None and not new.task.done()
            assert cache.detach("other", "c") is None  # never attached: nothing to stop
        finally:
            await cache.stop()


async def test_watches_never_take_the_connections_calls_need(apiserver: Any) -> None:
    """One informer per kind and namespace: with ten namespaces that is 90 watches open at once, more
    than the calls' pool holds (64). A call must still go through while they are all open."""
    srv = apiserver.server
    apiserver.call(srv.put(CM, cm("a")))
    async with Client(Connection(server=apiserver.url)) as api:

        async def hold(i: int) -> None:
            async for _ in api.watch("ConfigMap", f"ns-{i}", SELECTOR, str(srv.rv), timeout_s=60):
                pass

        watches = [asyncio.create_task(hold(i)) for i in range(80)]
        try:
            await until("80 watches open", lambda: sum(1 for c in srv.calls if c.verb == "watch") >= 80)
            got = await asyncio.wait_for(api.get("ConfigMap", "default", "a"), 10)
            assert got is not None and got["metadata"]["name"] == "a"
        finally:
            for w in watches:
                w.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
