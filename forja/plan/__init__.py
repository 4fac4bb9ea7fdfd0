"""`forja plan`: memory and time model of a parallel layout, hardware table and layout search."""
