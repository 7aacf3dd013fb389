"""The one line a failed job ends with says why."""

from tfdist.errors import error_reason

GRAPH_ERROR = """Graph execution error:

Detected at node cond/IteratorGetNext defined at (most recent call last):
  File "/work/tests/strategies/ps_scenarios.py", line 179, in <module>
  File "/work/tfdist/strategies/parameter_server.py", line 176, in worker_steps
Connection reset by peer
\t [[{{node cond/IteratorGetNext}}]]
Additional GRPC error information from remote target /job:worker/replica:0/task:1:
"""


def test_the_reason_is_the_line_that_says_why_not_where():
    assert error_reason(GRAPH_ERROR) == "Connection reset by peer"
    assert error_reason("Graph execution error:\n\n(0) UNAVAILABLE: socket closed\n(1) CANCELLED") == "UNAVAILABLE: socket closed"
    assert error_reason("") == "no reason given"
    full_disk = ("{{function_node __wrapped__SaveV2_dtypes_10_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
                 "/tmp/disk/.tmp-40-7/checkpoint_temp/part-00000-of-00001.data-00000-of-00001.tempstate1855; "
                 "No space left on device [Op:SaveV2] name: ")
    assert error_reason(full_disk) == ("/tmp/disk/.tmp-40-7/checkpoint_temp/part-00000-of-00001.data-00000-of-00001"
                                       ".tempstate1855; No space left on device")
