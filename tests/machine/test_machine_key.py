"""A cached choice is keyed by the CPU as it is: cloud VMs of three AMD generations all call
themselves "AMD EPYC", and a cache moved from one to another handed one's timed picks to the other."""

from __future__ import annotations

import pytest

from ouro import machine_cache

ZEN3 = {"cpu family": "25", "model": "1", "flags": "fpu sse avx avx2 fma"}
ZEN5 = {"cpu family": "26", "model": "2", "flags": "fpu sse avx avx2 fma avx512f avx512_bf16 avx512_vnni"}


def cpuinfo_text(fields: dict, name: str = "AMD EPYC") -> str:
    block = "".join(f"{k}\t: {v}\n" for k, v in {"processor": "0", "vendor_id": "AuthenticAMD", **fields,
                                                    "model name": name}.items())
    return block + "\n" + block.replace("processor\t: 0", "processor\t: 1") + "\n"


@pytest.fixture
def cpu(tmp_path, monkeypatch):
    def use(fields, name="AMD EPYC"):
        path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
        path.write_text(cpuinfo_text(fields, name))
        monkeypatch.setattr(machine_cache, "CPUINFO", str(path))
        return machine_cache.machine_key("cpu")
    return use


def test_same_name_other_generation_is_another_machine(cpu):
    zen3, zen5 = cpu(ZEN3), cpu(ZEN5)
    assert "AMD EPYC" in zen3 and "AMD EPYC" in zen5
    assert zen3 != zen5
    assert cpu({**ZEN3, "flags": ZEN5["flags"]}) != zen5                 # the family alone tells them apart
    assert cpu({**ZEN5, "flags": ZEN5["flags"] + " avx512vl"}) != zen5   # the flags alone too (a VM masking some)


def test_the_same_machine_keeps_its_key(cpu):
    first = cpu(ZEN5)
    assert cpu(dict(ZEN5)) == first
    assert cpu({**ZEN5, "flags": " ".join(reversed(ZEN5["flags"].split()))}) == first   # flags' order is no matter
    assert cpu(ZEN5, name="AMD EPYC 9B45") != first


def test_the_first_processor_is_read_and_names_are_exact(cpu):
    # "model" and "model name" are different entries: the model number is read, not the name
    key = cpu(ZEN5)
    assert "family 26 model 2," in key


def test_no_cpuinfo_falls_back_to_the_platform(cpu, tmp_path, monkeypatch):
    monkeypatch.setattr(machine_cache, "CPUINFO", str(tmp_path / "missing"))
    key = machine_cache.machine_key("cpu")
    assert key.startswith("cpu|") and "family" not in key
