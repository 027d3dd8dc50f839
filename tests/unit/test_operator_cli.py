"""`conveyor operator`'s flags: good values parse into settings, bad ones exit with argparse's error
naming the flag (never a traceback at start-up)."""

from __future__ import annotations

import pytest

from conveyor.operator.run import build_parser
from conveyor.operator.spec import DEFAULT_IMAGE


def test_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.server_image, args.network_policy_from, args.priority) == (DEFAULT_IMAGE, None, 0)
    assert (args.metrics_port, args.autoscale_interval, args.keda_polling_interval) == (8081, 15.0, 15)


def test_settings_parse() -> None:
    args = build_parser().parse_args(
        [
            "--server-image=r/s:1",
            '--network-policy-from=[{"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8"}}]',
            "--keda-authentication=prom-auth",
            "--keda-auth-modes=tls,basic",
            "--keda-prometheus-url=https://prom.example:9090",
            "--peering=conveyor",
            "--priority=random",
        ]
    )
    assert args.server_image == "r/s:1"
    assert args.network_policy_from == [{"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert args.keda_authentication == ("TriggerAuthentication", "prom-auth")
    assert args.keda_auth_modes == "tls,basic"
    assert 1 <= args.priority < 2**31
    cluster = build_parser().parse_args(["--keda-authentication", "ClusterTriggerAuthentication/prom"])
    assert cluster.keda_authentication == ("ClusterTriggerAuthentication", "prom")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--network-policy-from", "{"),
        ("--network-policy-from", '{"podSelector": {}}'),
        ("--network-policy-from", "[1]"),
        ("--network-policy-from", "[{}]"),
        ("--network-policy-from", '[{"bogus": 1}]'),
        ("--keda-authentication", "Secret/prom"),
        ("--keda-authentication", "/prom"),
        ("--keda-authentication", "ClusterTriggerAuthentication/Bad_Name"),
        ("--keda-auth-modes", "bogus"),
        ("--keda-polling-interval", "0"),
        ("--keda-prometheus-url", "notaurl"),
        ("--prometheus-url", "prometheus:9090"),
        ("--metrics-port", "-1"),
        ("--metrics-port", "99999"),
        ("--autoscale-interval", "nan"),
        ("--autoscale-interval", "inf"),
        ("--autoscale-interval", "0"),
        ("--server-image", ""),
        ("--peering", "Bad Name"),
        ("--priority", "high"),
    ],
)
def test_bad_values_exit_naming_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([f"{flag}={value}"])
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
