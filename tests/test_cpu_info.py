"""CPU facts: how many compute threads the engine allows itself."""

from pagedllm.cpu_info import available_cpus, cgroup_cpu_quota


def test_cgroup_quota_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert cgroup_cpu_quota(str(v2)) == 2
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(v1)) is None
    assert cgroup_cpu_quota(str(tmp_path / "none")) is None


def test_available_cpus_is_within_the_affinity():
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
