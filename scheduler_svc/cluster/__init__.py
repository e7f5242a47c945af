"""The scheduler's cluster process: worker membership and placement, the control listener,
engine core and front-end processes started and watched, the cluster's statistics and
/metrics, and the hub where engine cores and front ends report."""
