// The torch.library namespace of the kernels' operators: `pagedserve` (torch.ops.pagedserve.*).
// A second build loaded into the same process (the tests' build without AVX-512) passes
// -DPAGEDSERVE_OPS=<another name> so that its operators do not collide with these.
#pragma once

#ifndef PAGEDSERVE_OPS
#define PAGEDSERVE_OPS pagedserve
#endif
#define PAGEDSERVE_STRINGIFY_(x) #x
#define PAGEDSERVE_STRINGIFY(x) PAGEDSERVE_STRINGIFY_(x)
#define PAGEDSERVE_OPS_NAME PAGEDSERVE_STRINGIFY(PAGEDSERVE_OPS)
