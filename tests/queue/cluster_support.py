"""The loopback Redis Cluster the cluster tests share (producer.redis_cluster, which the
capacity benchmark starts too)."""

from producer.redis_cluster import RedisClusterNodes

__all__ = ["RedisClusterNodes"]
