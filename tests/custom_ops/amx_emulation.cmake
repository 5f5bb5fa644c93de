# AMX kernels on emulated tiles, for the C++ kernel tests only.
#
# Every custom_ops/kernels/*_amx.cc is compiled a second time with -DDSV4_AMX_EMULATION into the object library
# dsv4_amx_emu_objs. numerics/amx_tile.h then swaps the AMX intrinsics for a per-thread software tile file and
# renames the namespace dsv4::amx -> dsv4::amx_emu, so these objects link next to the real dsv4::amx kernels of
# dsv4_kernels without clashing. The emulation reproduces the instructions bit for bit (semantics in amx_tile.h),
# and a bad tile configuration or shape aborts with a message, so tiling bugs show up on any CPU.
#
# Flags: the project baseline only. No -mamx-*/-mavx* flag, and none is needed: the emulation is portable C++17.
# The per-file ISA flags of custom_ops/CMakeLists.txt are source-file properties of that directory and do not
# apply to targets created here. Consequence for kernel authors: an *_amx.cc may use ISA intrinsics only through
# amx_tile.h (or behind `#if !defined(DSV4_AMX_EMULATION)` with a portable alternative), or this build breaks.
#
# Usage, from the tests' CMakeLists.txt after the test executable exists:
#   include(${CMAKE_CURRENT_SOURCE_DIR}/amx_emulation.cmake)
#   target_sources(<test binary> PRIVATE $<TARGET_OBJECTS:dsv4_amx_emu_objs>)
# The snippet itself is platform-neutral (it also builds on non-x86 hosts).
file(GLOB DSV4_AMX_EMU_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/custom_ops/kernels/*_amx.cc)

add_library(dsv4_amx_emu_objs OBJECT ${DSV4_AMX_EMU_SOURCES})
target_compile_definitions(dsv4_amx_emu_objs PRIVATE DSV4_AMX_EMULATION=1)
target_include_directories(dsv4_amx_emu_objs PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/custom_ops)
set_target_properties(dsv4_amx_emu_objs PROPERTIES POSITION_INDEPENDENT_CODE ON)
