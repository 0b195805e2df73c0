from radixserve.mem.kv_pool import KVPool, PageAllocator, ReqToTokenPool

__all__ = ["KVPool", "PageAllocator", "ReqToTokenPool"]
