"""Memory objects and allocators (seed 000's `lmcache.experimental.memory_management`)."""

from lmcache.memory_management.allocators import (
    BufferAllocator,
    GPUMemoryAllocator,
    HostMemoryAllocator,
    MixedMemoryAllocator,
    PinMemoryAllocator,
)
from lmcache.memory_management.memory_obj import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
    release_all,
)
from lmcache.memory_management.tensor_allocator import (
    FreeBlock,
    MemoryAllocatorInterface,
    TensorMemoryAllocator,
)

__all__ = [
    "BufferAllocator", "BytesBufferMemoryObj", "FreeBlock", "GPUMemoryAllocator",
    "HostMemoryAllocator", "MemoryAllocatorInterface", "MemoryFormat", "MemoryObj",
    "MemoryObjMetadata", "MixedMemoryAllocator", "PinMemoryAllocator", "TensorMemoryAllocator",
    "TensorMemoryObj", "release_all",
]
