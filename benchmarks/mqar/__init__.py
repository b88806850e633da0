"""MQAR sweep: runs, their report and the batched trainer's throughput."""
