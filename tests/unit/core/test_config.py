import logging

import pytest

from lmcache.config import GB, LMCacheEngineConfig, LMCacheEngineMetadata


def test_defaults_are_the_seeds_except_remote_url():
    c = LMCacheEngineConfig.from_defaults()
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size, c.local_disk) == (256, True, 5.0, None)
    assert (c.max_local_disk_size, c.remote_serde, c.save_decode_cache) == (0.0, "naive", False)
    assert (c.enable_blending, c.blend_recompute_ratio, c.blend_min_tokens) == (False, 0.15, 256)
    assert (c.enable_p2p, c.lookup_url, c.distributed_url, c.error_handling) == (False, None, None, False)
    assert c.remote_url is None
    assert c.max_local_cpu_bytes == 5 * GB


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", 0), ("chunk_size", -256), ("max_local_cpu_size", -1.0),
        ("max_local_disk_size", -0.5), ("remote_url", "http://host:1"),
        ("remote_serde", "pickle"), ("blend_recompute_ratio", 1.5), ("chunk_size", "12a"),
        ("local_cpu", "maybe"), ("chunk_size", True), ("cache_policy", "MRU"),
        ("lookup_url", "localhost"), ("blend_check_layers", []),
    ],
)
def test_invalid_values_raise_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        LMCacheEngineConfig.from_defaults(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="chunksize"):
        LMCacheEngineConfig.from_defaults(chunksize=128)


def test_known_remote_schemes_are_accepted():
    for url in ("lm://h:1", "redis://h:1", "rediss://h:1", "valkey://h:1",
                "redis-sentinel://a:1,b:2/svc", "redis-cluster://a:1,b:2"):
        assert LMCacheEngineConfig.from_defaults(remote_url=url).remote_url == url


def test_file_prefix_is_stripped_from_local_disk():
    assert LMCacheEngineConfig.from_defaults(local_disk="file:///tmp/x").local_disk == "/tmp/x"


def test_p2p_needs_both_urls():
    with pytest.raises(ValueError, match="enable_p2p"):
        LMCacheEngineConfig.from_defaults(enable_p2p=True, lookup_url="h:1")
    c = LMCacheEngineConfig.from_defaults(enable_p2p=True, lookup_url="h:1", distributed_url="h:2")
    assert c.enable_p2p


def test_from_env_parses_types(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "false")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.5")
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://127.0.0.1:6379")
    monkeypatch.setenv("LMCACHE_LOOKUP_URL", "none")
    monkeypatch.setenv("LMCACHE_BLEND_CHECK_LAYERS", "1, 3")
    c = LMCacheEngineConfig.from_env()
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size) == (128, False, 0.5)
    assert c.remote_url == "redis://127.0.0.1:6379" and c.lookup_url is None
    assert c.blend_check_layers == [1, 3]


def test_from_env_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "big")
    with pytest.raises(ValueError, match="chunk_size"):
        LMCacheEngineConfig.from_env()


def test_unknown_lmcache_env_warns_but_known_non_fields_do_not(monkeypatch, caplog):
    monkeypatch.setenv("LMCACHE_CHUNKSIZE", "1")
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "INFO")
    with caplog.at_level(logging.WARNING, logger="lmcache.config"):
        LMCacheEngineConfig.from_env()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "LMCACHE_CHUNKSIZE" in warned and "LMCACHE_LOG_LEVEL" not in warned


def test_from_file_reads_yaml_and_rejects_unknown_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("chunk_size: 512\nlocal_disk: file:///data/kv\nmax_local_disk_size: 2.5\n")
    c = LMCacheEngineConfig.from_file(str(p))
    assert (c.chunk_size, c.local_disk, c.max_local_disk_size) == (512, "/data/kv", 2.5)
    p.write_text("chunk_sise: 512\n")
    with pytest.raises(ValueError, match="chunk_sise"):
        LMCacheEngineConfig.from_file(str(p))
    p.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        LMCacheEngineConfig.from_file(str(p))
    with pytest.raises(ValueError, match="cannot read"):
        LMCacheEngineConfig.from_file(str(tmp_path / "missing.yaml"))


def test_load_precedence_overrides_env_file_defaults(monkeypatch, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("chunk_size: 512\nmax_local_cpu_size: 1.0\nsave_decode_cache: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "2.0")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
    c = LMCacheEngineConfig.load({"chunk_size": 64})
    assert (c.chunk_size, c.max_local_cpu_size, c.save_decode_cache) == (64, 2.0, True)


def test_from_legacy_maps_backends():
    assert LMCacheEngineConfig.from_legacy(backend="cpu").local_cpu
    disk = LMCacheEngineConfig.from_legacy(backend="file:///tmp/kv", max_local_disk_size=3)
    assert disk.local_disk == "/tmp/kv" and disk.max_local_disk_size == 3.0
    remote = LMCacheEngineConfig.from_legacy(backend="redis://h:1")
    assert remote.remote_url == "redis://h:1"
    legacy = LMCacheEngineConfig.from_legacy(local_device="cuda", max_local_cache_size=1.5)
    assert legacy.local_cpu and legacy.max_local_cpu_size == 1.5
    legacy_disk = LMCacheEngineConfig.from_legacy(local_device="/tmp/kv2", max_local_cache_size=4)
    assert legacy_disk.local_disk == "/tmp/kv2" and legacy_disk.max_local_disk_size == 4.0


def test_metadata_rejects_what_cannot_work():
    import torch

    with pytest.raises(ValueError, match="kv_shape"):
        LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (30, 3, 256, 3, 64))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_shape"):
        LMCacheEngineMetadata("m", 1, 0, "vllm", torch.bfloat16, (30, 2, 256, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        LMCacheEngineMetadata("m", 0, 0, "vllm", torch.bfloat16, (30, 2, 256, 3, 64))
    with pytest.raises(ValueError, match="kv_dtype"):
        LMCacheEngineMetadata("m", 1, 0, "vllm", "float33", (30, 2, 256, 3, 64))  # type: ignore[arg-type]
    assert LMCacheEngineMetadata("m", 1, 0, "vllm", "bfloat16",  # type: ignore[arg-type]
                                 (30, 2, 256, 3, 64)).kv_dtype == torch.bfloat16


@pytest.mark.parametrize("worker_id, world_size", [(123, 3), (-1, 1)])
def test_metadata_accepts_an_out_of_range_worker_id_with_one_warning(worker_id, world_size, caplog,
                                                                      monkeypatch):
    import torch

    from lmcache.observability import forget_logged_once

    forget_logged_once()
    for _ in range(2):
        md = LMCacheEngineMetadata("m", world_size, worker_id, "vllm", torch.bfloat16, (30, 2, 256, 3, 64))
        assert md.worker_id == worker_id
    assert sum(f"worker_id={worker_id}" in r.message for r in caplog.records) == 1


LEGACY_NAMES = ["cpu", "local_disk", "local_cpu_disk", "remote", "local_cpu_remote", "local_disk_remote",
                "local_cpu_disk_remote"]


@pytest.mark.parametrize("name", LEGACY_NAMES)
def test_from_legacy_names_select_exactly_their_tiers(name, tmp_path):
    url = "redis://127.0.0.1:6399"
    c = LMCacheEngineConfig.from_legacy(backend=name, remote_url=url if "remote" in name else None,
                                        local_disk=str(tmp_path / "d"))
    assert c.local_cpu == ("cpu" in name)
    assert (c.local_disk is not None) == ("disk" in name)
    assert (c.remote_url == url) == ("remote" in name) and (c.remote_url is None) == ("remote" not in name)
    if c.local_disk is not None:
        assert c.local_disk == str(tmp_path / "d") and c.max_local_disk_size == 5.0


def test_from_legacy_disk_directory_defaults_and_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("LMCACHE_LOCAL_DISK", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    c = LMCacheEngineConfig.from_legacy(backend="local_disk", max_local_disk_size=2)
    assert c.local_disk == str(tmp_path / "xdg" / "lmcache" / "disk") and c.max_local_disk_size == 2.0
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", str(tmp_path / "env"))
    assert LMCacheEngineConfig.from_legacy(backend="local_cpu_disk").local_disk == str(tmp_path / "env")
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "env").exists()  # config creates nothing


@pytest.mark.parametrize("typo", ["local_dsk", "disk", "lokal_cpu", "mydir", ""])
def test_from_legacy_rejects_unknown_names_and_creates_nothing(typo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local_cpu_disk_remote"):
        LMCacheEngineConfig.from_legacy(backend=typo)
    with pytest.raises(ValueError, match="local_device"):
        LMCacheEngineConfig.from_legacy(local_device=typo or "x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw", [{"backend": None}, {"backend": 5}, {"backend": ["cpu"]}, {"local_device": 0}])
def test_from_legacy_refuses_a_backend_that_is_not_a_string_with_the_valid_names(kw):
    with pytest.raises(ValueError, match=r"unknown legacy .*a device"):  # was a TypeError from re / dict
        LMCacheEngineConfig.from_legacy(**kw)


def test_from_legacy_remote_names_need_a_remote_url_and_others_ignore_it(caplog):
    with pytest.raises(ValueError, match="remote_url"):
        LMCacheEngineConfig.from_legacy(backend="local_cpu_remote")
    c = LMCacheEngineConfig.from_legacy(backend="cpu", remote_url="lm://127.0.0.1:65432")
    assert c.remote_url is None and "ignored" in caplog.text
    # the device / path / URL forms still combine with remote_url, as before
    assert LMCacheEngineConfig.from_legacy(backend="cuda", remote_url="lm://h:1").remote_url == "lm://h:1"
    disk = LMCacheEngineConfig.from_legacy(backend="file:///tmp/kv")
    assert disk.local_cpu and disk.local_disk == "/tmp/kv" and disk.max_local_disk_size == 5.0


def test_from_legacy_and_its_tables_answer_from_the_config_module_as_before():
    from lmcache.compat import legacy_config
    from lmcache.config import DEFAULT_LEGACY_DISK_GB, LEGACY_BACKENDS, LegacyTiers, default_local_disk

    assert LEGACY_BACKENDS is legacy_config.LEGACY_BACKENDS
    assert LEGACY_BACKENDS["cpu"] == LegacyTiers(True, False, False)
    assert DEFAULT_LEGACY_DISK_GB == 5.0 and default_local_disk().endswith("lmcache/disk")
    c = LMCacheEngineConfig.from_legacy(16, "cuda", "lm://h:1")  # seed 000's positional order
    assert (c.chunk_size, c.local_cpu, c.remote_url) == (16, True, "lm://h:1")
    with pytest.raises(TypeError):
        LMCacheEngineConfig.from_legacy(backnd="cpu")
    with pytest.raises(AttributeError):
        import lmcache.config

        lmcache.config.NOT_A_NAME  # noqa: B018


def test_a_remote_url_of_an_unknown_scheme_is_refused_without_echoing_its_secrets():
    with pytest.raises(ValueError, match=r"remote_url='memcache://user:\*\*\*@h:1\?ttl=5'") as e:
        LMCacheEngineConfig(remote_url="memcache://user:S3cret@h:1?auth_token=T0k&ttl=5")
    assert "S3cret" not in str(e.value) and "T0k" not in str(e.value)
    with pytest.raises(ValueError, match="remote_url=\"\\(no '://'\\)\"") as e:
        LMCacheEngineConfig(remote_url="user:S3cret@h:1")
    assert "S3cret" not in str(e.value)


def test_a_refused_lookup_url_is_not_echoed_with_its_password():
    with pytest.raises(ValueError, match=r"lookup_url='lm://user:\*\*\*@h:1'") as e:
        LMCacheEngineConfig(lookup_url="lm://user:S3cret@h:1")
    assert "S3cret" not in str(e.value)


def test_the_repr_of_a_config_hides_the_secrets_of_its_urls():
    c = LMCacheEngineConfig(remote_url="lm://h:1?auth_token=T0k&ttl=5", lookup_url="redis://:S3cret@h:2")
    shown = repr(c)
    assert "T0k" not in shown and "S3cret" not in shown
    assert "remote_url='lm://h:1?ttl=5'" in shown and "lookup_url='redis://:***@h:2'" in shown
    assert c.remote_url == "lm://h:1?auth_token=T0k&ttl=5"  # the config itself keeps them


@pytest.mark.parametrize("field", ["max_local_cpu_size", "max_local_disk_size", "remote_timeout",
                                   "lookup_timeout", "p2p_ttl", "pd_send_timeout"])
@pytest.mark.parametrize("value", ["inf", float("inf"), "Infinity"])
def test_a_size_or_time_that_is_not_finite_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"invalid config value {field}=.*expected a finite number"):
        LMCacheEngineConfig.from_defaults(**{field: value})


def test_a_config_file_with_keys_of_mixed_types_or_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("1: x\nchunk_sise: 512\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\): \[1, 'chunk_sise'\]"):
        LMCacheEngineConfig.from_file(str(p))
    p.write_bytes(b"chunk_size: 256\nlocal_disk: /data/\xff\n")
    with pytest.raises(ValueError, match=f"cannot read LMCache config file '{p}'"):
        LMCacheEngineConfig.from_file(str(p))
