"""Cluster resolvers: every valid TF_CONFIG / torchrun form, the default rule, and every
malformed configuration's error (variable name or JSON path in the message)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mirrored._src.cluster.parse import parse_environ, parse_tf_config, parse_torchrun
from mirrored.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    default_cluster_resolver,
)

WORKERS = ["h0:2222", "h1:2223", "h2:2224"]


def tf_env(config: object) -> dict[str, str]:
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


def torchrun_env(**overrides: str | None) -> dict[str, str]:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    env.update(overrides)  # type: ignore[arg-type]
    return {k: v for k, v in env.items() if v is not None}


# --- TF_CONFIG: valid forms ---------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, 2])
def test_tf_config_workers_only(index):
    r = TFConfigClusterResolver(tf_env({"cluster": {"worker": WORKERS},
                                        "task": {"type": "worker", "index": index}}))
    s = r.spec
    assert (s.num_workers, s.worker_index, s.task_type, s.task_id) == (3, index, "worker", index)
    assert (r.num_workers, r.worker_index, r.task_type, r.task_id) == (3, index, "worker", index)
    assert s.is_chief == r.is_chief == (index == 0)
    assert (s.master_addr, s.master_port, s.master_address) == ("h0", 2222, "h0:2222")
    assert (s.local_rank, s.local_world_size, s.source) == (0, 1, "TF_CONFIG")
    assert r.cluster_spec() is s
    assert s.as_dict() == {"worker": WORKERS}
    assert r.master() == "h0:2222"
    assert r.master(rpc_layer="grpc") == "grpc://h0:2222"
    assert s.init_method == "tcp://h0:2222"
    assert r.master("worker", 2) == "h2:2224"


@pytest.mark.parametrize(("task_type", "index", "worker_index"),
                         [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_tf_config_chief_is_id_zero_and_workers_follow(task_type, index, worker_index):
    config = {"cluster": {"worker": ["w0:1", "w1:1"], "chief": ["c:9"]},
              "task": {"type": task_type, "index": index}}
    r = TFConfigClusterResolver(tf_env(config))
    assert (r.worker_index, r.task_type, r.task_id) == (worker_index, task_type, index)
    assert r.num_workers == 3
    assert r.is_chief == (task_type == "chief")
    assert r.master() == "c:9"  # the chief's address, not worker 0's
    assert r.spec.jobs == (("chief", ("c:9",)), ("worker", ("w0:1", "w1:1")))
    assert r.master("chief", 0) == "c:9"


def test_tf_config_chief_only_index_default_extra_keys_and_ipv6():
    r = TFConfigClusterResolver(tf_env({"cluster": {"chief": ["[::1]:7000"], "worker": []},
                                        "task": {"type": "chief"}, "rpc_layer": "grpc",
                                        "environment": "cloud"}))
    assert (r.num_workers, r.worker_index, r.task_id, r.is_chief) == (1, 0, 0, True)
    assert (r.spec.master_addr, r.spec.master_port) == ("::1", 7000)
    assert r.master() == "[::1]:7000"
    assert r.spec.as_dict() == {"chief": ["[::1]:7000"]}


@given(has_chief=st.booleans(), n_workers=st.integers(0, 6), data=st.data())
def test_tf_config_ids_are_a_permutation_with_chief_first(has_chief, n_workers, data):
    if not has_chief and n_workers == 0:
        n_workers = 1
    cluster = {"worker": [f"w{i}:{1000 + i}" for i in range(n_workers)]}
    if has_chief:
        cluster["chief"] = ["c:999"]
    tasks = [("chief", 0)] * has_chief + [("worker", i) for i in range(n_workers)]
    ids = []
    for task_type, index in tasks:
        spec = parse_tf_config(tf_env({"cluster": cluster,
                                       "task": {"type": task_type, "index": index}}))
        ids.append(spec.worker_index)
        assert (spec.task_type, spec.task_id) == (task_type, index)
        assert spec.master_address == ("c:999" if has_chief else "w0:1000")
    assert ids == list(range(len(tasks)))  # chief 0, then workers in order
    # The spec's torchrun variables describe the same process.
    task_type, index = data.draw(st.sampled_from(tasks))
    spec = parse_tf_config(tf_env({"cluster": cluster, "task": {"type": task_type,
                                                                "index": index}}))
    again = parse_torchrun(spec.torch_env())
    assert (again.worker_index, again.num_workers, again.master_address) == (
        spec.worker_index, spec.num_workers, spec.master_address)


# --- TF_CONFIG: errors --------------------------------------------------------------

TASK = {"type": "worker", "index": 0}
TF_ERRORS = [
    ({}, r"TF_CONFIG is not set"),
    ({"TF_CONFIG": "  "}, r"TF_CONFIG is not set"),
    (tf_env('{"cluster": '), r"TF_CONFIG is not valid JSON: .* line 1 column 13"),
    (tf_env("[1, 2]"), r"TF_CONFIG must be a JSON object; got an array"),
    (tf_env({"task": TASK}), r'TF_CONFIG has no "cluster"'),
    (tf_env({"cluster": ["h:1"], "task": TASK}),
     r'TF_CONFIG\["cluster"\] must be an object .* got an array'),
    (tf_env({"cluster": {"worker": ["h:1"], "ps": ["p:1"]}, "task": TASK}),
     r"""TF_CONFIG\["cluster"\] has a job 'ps'; .* only 'chief' and 'worker'"""),
    (tf_env({"cluster": {"worker": "h:1"}, "task": TASK}),
     r'TF_CONFIG\["cluster"\]\["worker"\] must be an array .* got a string'),
    (tf_env({"cluster": {"worker": ["h:1", 5]}, "task": TASK}),
     r'TF_CONFIG\["cluster"\]\["worker"\]\[1\] must be a .host:port. string; got int 5'),
    (tf_env({"cluster": {"worker": ["h:1", "h2"]}, "task": TASK}),
     r"""TF_CONFIG\["cluster"\]\["worker"\]\[1\] .* got 'h2', which has no host or no"""),
    (tf_env({"cluster": {"worker": ["h:1", "h2:http"]}, "task": TASK}),
     r"""port of TF_CONFIG\["cluster"\]\["worker"\]\[1\] \('h2:http'\) must be a port """
     r"number .* got 'http'"),
    (tf_env({"cluster": {"worker": ["h:99999"]}, "task": TASK}),
     r'port of TF_CONFIG\["cluster"\]\["worker"\]\[0\] .* in 1..65535; got 99999'),
    (tf_env({"cluster": {"worker": ["::1:80"]}, "task": TASK}),
     r"IPv6 host in brackets .* got '::1:80'"),
    (tf_env({"cluster": {"chief": ["a:1", "b:1"], "worker": ["h:1"]}, "task": TASK}),
     r'at most one chief; TF_CONFIG\["cluster"\]\["chief"\] has 2'),
    (tf_env({"cluster": {}, "task": TASK}), r'TF_CONFIG\["cluster"\] has no workers'),
    (tf_env({"cluster": {"worker": []}, "task": TASK}), r'TF_CONFIG\["cluster"\] has no workers'),
    (tf_env({"cluster": {"worker": ["h:1"]}}), r'TF_CONFIG has no "task"'),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": "worker"}),
     r'TF_CONFIG\["task"\] must be an object .* got a string'),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"index": 0}}),
     r'TF_CONFIG\["task"\] has no "type"'),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"type": "evaluator"}}),
     r"""TF_CONFIG\["task"\]\["type"\] must be "chief" or "worker"; got 'evaluator'"""),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"type": "chief"}}),
     r"""TF_CONFIG\["task"\]\["type"\] is 'chief' but TF_CONFIG\["cluster"\] has no 'chief'"""),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}),
     r"""TF_CONFIG\["task"\]\["index"\] must be an integer; got a string '0'"""),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": True}}),
     r'TF_CONFIG\["task"\]\["index"\] must be an integer; got a boolean True'),
    (tf_env({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 2}}),
     r'TF_CONFIG\["task"\]\["index"\] is 2 but TF_CONFIG\["cluster"\]\["worker"\] has 2 '
     r"address\(es\), so it must be in 0..1"),
    (tf_env({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": -1}}),
     r'TF_CONFIG\["task"\]\["index"\] is -1 .* must be in 0..0'),
]


@pytest.mark.parametrize(("environ", "match"), TF_ERRORS)
def test_tf_config_errors(environ, match):
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver(environ)


# --- torchrun: valid forms and errors -----------------------------------------------


def test_torchrun_without_and_with_local_world_size():
    r = TorchrunClusterResolver(torchrun_env())
    s = r.spec
    assert (s.num_workers, s.worker_index, s.task_type, s.task_id) == (4, 1, "worker", 1)
    assert (s.local_rank, s.local_world_size, s.source) == (1, 2, "torchrun")
    assert (r.master(), r.is_chief, s.jobs, s.as_dict()) == ("10.0.0.1:29500", False, (), {})
    s = parse_torchrun(torchrun_env(RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                                    MASTER_PORT=" 1234 "))
    assert (s.worker_index, s.is_chief, s.local_world_size, s.master_port) == (0, True, 2, 1234)
    assert s.torch_env() == {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "1234"}


TORCHRUN_ERRORS = [
    *[(torchrun_env(**{name: None}), rf"^{name} is not set; .*needs all of RANK, WORLD_SIZE")
      for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")],
    (torchrun_env(RANK="one"), r"RANK must be an integer >= 0; got 'one'"),
    (torchrun_env(RANK="1.0"), r"RANK must be an integer >= 0; got '1.0'"),
    (torchrun_env(RANK="-1"), r"RANK must be an integer >= 0; got '-1'"),
    (torchrun_env(RANK=""), r"RANK must be an integer >= 0; got ''"),
    (torchrun_env(RANK="4"), r"RANK must be less than WORLD_SIZE \(4\); got RANK=4"),
    (torchrun_env(WORLD_SIZE="0"), r"WORLD_SIZE must be an integer >= 1; got 0"),
    (torchrun_env(LOCAL_RANK="x"), r"LOCAL_RANK must be an integer >= 0; got 'x'"),
    (torchrun_env(LOCAL_RANK="4"), r"LOCAL_RANK must be less than WORLD_SIZE \(4\)"),
    (torchrun_env(LOCAL_WORLD_SIZE="0"), r"LOCAL_WORLD_SIZE must be an integer >= 1; got 0"),
    (torchrun_env(LOCAL_WORLD_SIZE="5"), r"LOCAL_WORLD_SIZE must be at most WORLD_SIZE \(4\)"),
    (torchrun_env(LOCAL_WORLD_SIZE="1"),
     r"LOCAL_RANK must be less than LOCAL_WORLD_SIZE \(1\); got LOCAL_RANK=1"),
    (torchrun_env(MASTER_ADDR=" "), r"MASTER_ADDR must be the rendezvous host"),
    (torchrun_env(MASTER_PORT="http"), r"MASTER_PORT must be a port number .* got 'http'"),
    (torchrun_env(MASTER_PORT="0"), r"MASTER_PORT must be a port number in 1..65535; got 0"),
    (torchrun_env(MASTER_PORT="65536"), r"MASTER_PORT must be .* in 1..65535; got 65536"),
]


@pytest.mark.parametrize(("environ", "match"), TORCHRUN_ERRORS)
def test_torchrun_errors(environ, match):
    with pytest.raises(ValueError, match=match):
        TorchrunClusterResolver(environ)


def test_torchrun_error_lists_what_is_set():
    with pytest.raises(ValueError, match=r"got RANK='0', WORLD_SIZE='2'\)"):
        parse_torchrun({"RANK": "0", "WORLD_SIZE": "2"})


# --- the default rule ---------------------------------------------------------------

TF_ONE = json.dumps({"cluster": {"worker": ["t:1", "t:2"]}, "task": {"type": "worker",
                                                                      "index": 1}})


@pytest.mark.parametrize(("environ", "kind", "source", "worker_index"), [
    ({}, SimpleClusterResolver, "local", 0),
    ({"TF_CONFIG": "", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, SimpleClusterResolver,
     "local", 0),
    ({"TF_CONFIG": TF_ONE}, TFConfigClusterResolver, "TF_CONFIG", 1),
    ({**torchrun_env(RANK="3"), "TF_CONFIG": TF_ONE}, TorchrunClusterResolver, "torchrun", 3),
])
def test_default_rule(environ, kind, source, worker_index):
    r = default_cluster_resolver(environ)
    assert type(r) is kind
    assert isinstance(r, ClusterResolver)
    assert (r.spec.source, r.worker_index) == (source, worker_index)
    assert parse_environ(environ) == r.spec


def test_default_local_is_one_worker():
    s = default_cluster_resolver({}).spec
    assert (s.num_workers, s.worker_index, s.is_chief, s.task_type, s.task_id) == (
        1, 0, True, "worker", 0)


def test_default_rule_errors_name_the_chosen_source():
    with pytest.raises(ValueError, match=r"^WORLD_SIZE is not set"):
        default_cluster_resolver({"LOCAL_RANK": "0", "TF_CONFIG": TF_ONE})
    with pytest.raises(ValueError, match=r'TF_CONFIG has no "task"'):
        default_cluster_resolver({"TF_CONFIG": '{"cluster": {"worker": ["h:1"]}}'})


def test_os_environ_is_the_default(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", TF_ONE)
    assert default_cluster_resolver().worker_index == 1
    assert TFConfigClusterResolver().master("worker", 0) == "t:1"
    for name, value in torchrun_env(RANK="2").items():
        monkeypatch.setenv(name, value)
    assert default_cluster_resolver().worker_index == TorchrunClusterResolver().worker_index == 2


# --- SimpleClusterResolver, ClusterSpec, master() -----------------------------------


def test_simple_resolver_from_fields_cluster_and_spec():
    r = SimpleClusterResolver(num_workers=3, worker_index=1, master_addr="c", master_port=9,
                              cluster={"worker": ["w0:1", "w1:1"], "chief": ["c:9"]})
    assert (r.task_type, r.task_id, r.worker_index, r.master()) == ("worker", 0, 1, "c:9")
    assert r.spec.source == "explicit"
    spec = ClusterSpec(num_workers=2, worker_index=1, local_rank=1, local_world_size=2)
    assert SimpleClusterResolver(spec).spec is spec
    assert SimpleClusterResolver().spec == ClusterSpec()
    assert repr(SimpleClusterResolver(spec)).startswith("SimpleClusterResolver(ClusterSpec(")


def test_cluster_spec_is_frozen_and_hashable():
    spec = parse_tf_config(tf_env({"cluster": {"worker": WORKERS}, "task": TASK}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.worker_index = 1  # type: ignore[misc]
    assert hash(spec) == hash(parse_tf_config(tf_env({"cluster": {"worker": WORKERS},
                                                      "task": TASK})))


def test_num_accelerators_matches_torch():
    import torch

    count = torch.cuda.device_count()
    assert SimpleClusterResolver().num_accelerators() == ({"GPU": count} if count else {})


@pytest.mark.parametrize(("fields", "match"), [
    ({"num_workers": 0}, r"ClusterSpec.num_workers must be an int >= 1; got int 0"),
    ({"num_workers": 2.0}, r"ClusterSpec.num_workers must be an int >= 1; got float 2.0"),
    ({"num_workers": 2, "worker_index": 2}, r"worker_index must be an int in 0..1; got int 2"),
    ({"worker_index": True}, r"worker_index must be an int in 0..0; got bool True"),
    ({"master_port": 0}, r"master_port must be an int in 1..65535; got int 0"),
    ({"master_addr": ""}, r"master_addr must be a non-empty host"),
    ({"local_world_size": 2}, r"local_world_size must be an int in 1..1; got int 2"),
    ({"num_workers": 2, "local_rank": 1}, r"local_rank must be an int in 0..0; got int 1"),
    ({"source": "slurm"}, r"ClusterSpec.source must be one of .* got 'slurm'"),
    ({"jobs": "worker"}, r"ClusterSpec.jobs must be a tuple of \(job name, tuple"),
    ({"jobs": (("worker", ("a:1",)), ("chief", ("b:1",)))},
     r"must name each of \('chief', 'worker'\) at most once, in that order; got \['worker', "),
    ({"jobs": (("worker", ()),)}, r"ClusterSpec.jobs\['worker'\] has no addresses"),
    ({"num_workers": 2, "jobs": (("chief", ("a:1", "b:1")),)}, r"at most one chief"),
    ({"jobs": (("worker", ("a",)),)}, r"ClusterSpec.jobs\['worker'\]\[0\] must be a"),
    ({"num_workers": 3, "jobs": (("worker", ("a:1", "b:1")),)},
     r"ClusterSpec.jobs list 2 task\(s\) but num_workers is 3"),
])
def test_cluster_spec_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**fields)


def test_simple_resolver_errors():
    with pytest.raises(TypeError, match=r"either a spec or its fields, not both; got a spec "
                                        r"and \['num_workers'\]"):
        SimpleClusterResolver(ClusterSpec(), num_workers=1)
    with pytest.raises(TypeError, match=r"spec must be a ClusterSpec; got dict"):
        SimpleClusterResolver({"num_workers": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cluster must be a mapping .* got list"):
        SimpleClusterResolver(cluster=["a:1"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cluster may only have the jobs .* got \['ps'\]"):
        SimpleClusterResolver(cluster={"worker": ["a:1"], "ps": ["p:1"]})
    with pytest.raises(ValueError, match=r"jobs list 1 task\(s\) but num_workers is 2"):
        SimpleClusterResolver(num_workers=2, cluster={"worker": ["a:1"]})


def test_master_errors():
    r = TFConfigClusterResolver(tf_env({"cluster": {"worker": WORKERS}, "task": TASK}))
    with pytest.raises(ValueError, match=re.escape("needs both task_type and task_id, or "
                                                   "neither; got task_type='worker', "
                                                   "task_id=None")):
        r.master("worker")
    with pytest.raises(ValueError, match=r"no task \('worker', 3\) in this cluster; it lists "
                                         r"worker 0..2"):
        r.master("worker", 3)
    with pytest.raises(ValueError, match=r"no task \('chief', 0\) .* lists worker 0..2"):
        r.master("chief", 0)
    with pytest.raises(ValueError, match=r"lists no addresses \(source: torchrun\)"):
        TorchrunClusterResolver(torchrun_env()).master("worker", 0)
