# PyTorch's test file is run through torch_optim_harness.py (with optim_db's Muon entry swapped), never collected
# as it is: its imports of test/optim/ would fail, and it would run every optimizer's tests.
collect_ignore = ["upstream"]
