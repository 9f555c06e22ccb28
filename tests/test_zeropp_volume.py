"""Measured bytes of ZeRO-3 and ZeRO++ against the analytic model, and the 0.27x target."""

import pytest

from zeropp_tools.bench.comm import format_report, run


@pytest.mark.parametrize("layout", [(2, 2), (2, 4)])
def test_all_three_cut_cross_node_bytes_and_match_prediction(layout):
    report = run([layout], model_size="tiny", tokens=(2, 32))
    print(format_report(report))
    rows = report["layouts"][f"{layout[0]}x{layout[1]}"]
    for name, row in rows.items():
        for phase, predicted in row["phases"]["predicted"].items():
            for key, value in predicted.items():
                measured = row["phases"]["measured"][phase][key]
                assert abs(measured - value) <= 0.01 * value, (name, phase, key, measured, value)
    assert rows["zero++"]["inter_node_vs_zero3"] <= 0.27
    assert rows["hpz"]["phases"]["measured"]["backward_gather"]["received_inter_node"] == 0
    assert rows["qwz"]["measured"]["inter_node"] < rows["zero3"]["measured"]["inter_node"]
    assert rows["qgz"]["measured"]["inter_node"] < rows["zero3"]["measured"]["inter_node"]
