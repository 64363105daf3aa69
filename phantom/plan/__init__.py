"""Which placement: the cost model (pure) and the tuner that measures the machine."""
