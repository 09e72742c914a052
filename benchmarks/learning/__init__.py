"""What the learning comparisons share (bench_learning, bench_sas_variants,
bench_sas_downstream): ``setting`` (the models and the run settings they share), ``peers``
(transformers' BERT and ELECTRA, SAS's objective written independently), ``peer_loop`` (the
peers' training loop, one process each), ``runs`` (the runs, several at a time), ``curves``
(the held-out records read back), ``report`` (bench_learning's table and plot) and
``variants`` (SAS's variants and the training FLOPs of each model).
"""
