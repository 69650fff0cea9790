"""What may run where, decided before any work: the option catalogue read from configs/, `check()` over a
combination's needs for a device, and which settings a job would ignore."""
