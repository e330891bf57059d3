"""The GLM-5.3-Flash oracle: the readable reference that defines every bit of the output."""
