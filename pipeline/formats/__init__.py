"""Facts about how targets write their replies, shared by generate (which reads replies) and the
training stages (which rebuild them): no I/O, no model code."""
