// Host side of the phase stamps (runtime/phase_stamps.cuh): enabled only in a build with
// -DV4ATTN_PHASE_STAMPS; otherwise available() is false and the other calls do nothing.
#pragma once

#include <string>

namespace v4attn::stamps {

bool available();
// Allocates the device buffer on first use, binds every stamping unit to it and clears it.
void reset();
// Writes the recorded entries as text after a "# v4attn phase stamps v2" header line, one per
// line: global_ns gridid kind sm cta_x cta_y phase record (gridid: the launch's %gridid; record:
// the stamping thread's record index; scripts/phase_stamps.py reads this format and the older one
// without the header, whose second column was clock64).
// Returns the number of entries written.
long dump(const std::string& path);

}  // namespace v4attn::stamps
