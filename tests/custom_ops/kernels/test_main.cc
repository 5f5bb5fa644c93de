// Entry point of dsv4_kernel_tests: runs the tests registered by every test_*.cc (see kt.h for the options).
#include "kt.h"

int main(int argc, char** argv) { return kt::Main(argc, argv); }
