"""The hand-written Prometheus histograms: one series per label value, in the order given, buckets cumulative."""

import pytest

from k6serve.serve.metrics import Histogram, ServerMetrics


def test_a_labelled_histogram_renders_one_series_per_value_in_the_given_order():
    histogram = Histogram("h_seconds", "help", (1.0, 10.0), label="stage", label_values=("a", "b"))
    histogram.observe(20.0, "z")  # not among label_values: after them
    histogram.observe(5.0, "b")
    histogram.observe(0.5, "a")
    histogram.observe(1.0, "a")  # on a bound: in that bucket (le is <=)
    assert histogram.render() == [
        "# HELP h_seconds help", "# TYPE h_seconds histogram",
        'h_seconds_bucket{stage="a",le="1"} 2', 'h_seconds_bucket{stage="a",le="10"} 2',
        'h_seconds_bucket{stage="a",le="+Inf"} 2', 'h_seconds_sum{stage="a"} 1.500000', 'h_seconds_count{stage="a"} 2',
        'h_seconds_bucket{stage="b",le="1"} 0', 'h_seconds_bucket{stage="b",le="10"} 1',
        'h_seconds_bucket{stage="b",le="+Inf"} 1', 'h_seconds_sum{stage="b"} 5.000000', 'h_seconds_count{stage="b"} 1',
        'h_seconds_bucket{stage="z",le="1"} 0', 'h_seconds_bucket{stage="z",le="10"} 0',
        'h_seconds_bucket{stage="z",le="+Inf"} 1', 'h_seconds_sum{stage="z"} 20.000000',
        'h_seconds_count{stage="z"} 1']


def test_an_unlabelled_histogram_renders_as_before_and_refuses_a_label():
    histogram = Histogram("j_seconds", "help", (1.0,))
    assert histogram.render()[2:] == ['j_seconds_bucket{le="1"} 0', 'j_seconds_bucket{le="+Inf"} 0',
                                      "j_seconds_sum 0.000000", "j_seconds_count 0"]
    with pytest.raises(ValueError, match="j_seconds has no label"):
        histogram.observe(1.0, "a")
    with pytest.raises(ValueError, match="a value of label 'stage' is needed"):
        Histogram("k", "help", (1.0,), label="stage").observe(1.0)


def test_stages_take_seconds_and_leave_out_counts_statistics_and_the_total():
    metrics = ServerMetrics()
    metrics.stages({"total": 9.0, "expand_prompt": 7.5, "encode": 0.05, "denoise": 58.4, "denoise_per_step": 5.8,
                    "denoise_step_median": 5.8, "graphs_compiled": 0.0, "decode_video": 2.6, "gc_freeze": 0.01,
                    "mux": 0.2, "read": 1.0, "dit": 12.0, "blend": 0.3, "warmup": 3.0})
    body = metrics.render(queue_depth=0, jobs_by_status={}, running=0)
    counts = [line for line in body.splitlines() if line.startswith("k6serve_stage_seconds_count")]
    assert counts == [f'k6serve_stage_seconds_count{{stage="{stage}"}} 1' for stage in (
        "warmup", "read", "expand_prompt", "encode", "denoise", "dit", "decode_video", "blend", "mux")]
