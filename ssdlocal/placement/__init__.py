"""Where models run: device inventory, the placement planner, CPU core splits for SSD on
one machine, and device-list arguments such as `cuda:0-3`."""
