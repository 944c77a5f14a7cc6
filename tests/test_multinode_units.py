"""The host-list, placement and failure-parsing pieces of running across hosts (no hosts
needed: the multinode tests run them for real on simulated hosts)."""
import pytest

from nbdist.mpi.hosts import (HostsError, banner_deaths, check_slots, hosts_arg, lost_host_line,
                              lost_hosts_in, parse_hosts, placement, remote_death_line)
from nbdist.mpi.hydra import parse_exit_codes


def test_host_list_as_horovodrun():
    assert parse_hosts("h1:2,h2:2") == [("h1", 2), ("h2", 2)]
    assert parse_hosts(["h1:3", "h2"]) == [("h1", 3), ("h2", 1)]
    assert hosts_arg(parse_hosts("a:2, b:1")) == "a:2,b:1"
    for bad, words in [("h1:0", "positive"), ("h1:x", "positive"), ("h1,h1", "twice"), ("a b:2", "host:slots")]:
        with pytest.raises(HostsError, match=words):
            parse_hosts(bad)
    check_slots(4, [("a", 2), ("b", 2)])
    with pytest.raises(HostsError, match="-n 5 needs 5 slots, but --hosts a:2,b:2 gives 4"):
        check_slots(5, [("a", 2), ("b", 2)])


def test_placement_fills_hosts_in_order():
    assert placement([("h1", 3), ("h2", 1)], 4) == {"h1": [0, 1, 2], "h2": [3]}
    assert placement([("h1", 2), ("h2", 2)], 3) == {"h1": [0, 1], "h2": [2]}


def test_exit_codes_of_several_hosts():
    out = "[mpiexec@vm] Exit codes: [h1] 0,0\n[h2] 0,256\nrank output\n"
    assert parse_exit_codes(out) == {0: 0, 1: 0, 2: 0, 3: 256}
    # a rank printing "[0] 1,2" after the report is not part of it
    assert parse_exit_codes("[mpiexec@vm] Exit codes: [h1] 0\nhello\n[0] 1,2\n") == {0: 0}


def test_hydra_banner_nanny_and_ssh_words():
    banner = ("===\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   PID 7105 RUNNING AT h2\n=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\n")
    assert banner_deaths(banner) == [("h2", 9)]
    words = "Connection to 198.18.5.12 closed by remote host.\n"
    assert lost_hosts_in(words, {"h1": "198.18.5.11", "h2": "198.18.5.12"}) == ["h2"]
    assert lost_host_line("h2", [2, 3]) == ("host h2 was lost (hydra's ssh connection to it ended): "
                                            "ranks 2-3 on h2 are out of reach")
    assert remote_death_line("h2", 9, 3, [2, 3]) == ("rank 3 on h2 died (killed by signal 9 (SIGKILL), "
                                                     "as hydra reports it)")
    assert "ranks 2-3 ran there, and hydra does not say which" in remote_death_line("h2", 1, None, [2, 3])


def test_remote_death_is_the_cause_not_the_local_ranks_hydra_killed(tmp_path, capsys):
    """Across hosts hydra's exit-code report covers only this host's ranks, which its clean-up
    SIGKILLed after a rank on h2 died: the run names h2's death, and the local ranks as stopped."""
    from nbdist.cli.run import _summarise

    out = ("===\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
           "=   PID 7105 RUNNING AT h2\n=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\n"
           "[mpiexec@vm] Exit codes: [h1] 0,9\n")
    code = _summarise(137, out, str(tmp_path), 4, None, False, False, 0.0,
                      slots=[("h1", 2), ("h2", 2)])
    err = capsys.readouterr().err
    assert code == 137
    assert "a rank on h2 died (killed by signal 9 (SIGKILL), as hydra reports it" in err, err
    assert "rank 1 was stopped by MPI after the failure" in err, err
    assert "rank 1 died" not in err, err


def test_death_records_name_a_rank_only_when_certain(tmp_path):
    """nbdist run names the first rank to die on a host only when its segment keeper saw every
    other rank there still running: a keeper that woke late (after hydra's clean-up killed the
    others) names no one, and the rank killed after it is never taken for the first."""
    from nbdist.cli.run import _first_exits
    from nbdist.wire import write_death_record

    where = {"h1": [0, 1], "h2": [2, 3]}
    write_death_record(str(tmp_path), 2, "h2", [])  # killed by hydra after rank 3: 3 was gone
    assert _first_exits(str(tmp_path), where) == {}
    write_death_record(str(tmp_path), 3, "h2", [])  # its keeper woke late, when 2 was gone too
    assert _first_exits(str(tmp_path), where) == {}
    write_death_record(str(tmp_path), 3, "h2", [2])  # 2 still ran when 3 was seen gone
    assert _first_exits(str(tmp_path), where) == {"h2": 3}
    write_death_record(str(tmp_path), 0, "h1", [])  # h1's rank 1 was gone too: not certain
    assert "h1" not in _first_exits(str(tmp_path), where)
