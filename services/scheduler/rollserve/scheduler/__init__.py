"""The rollserve scheduler: queues prompt groups, places them on engines, delivers to Redis."""
