# Labels for the tests of remat_tests (ctest -L LABEL, ctest -LE LABEL). CMakeLists.txt has
# ctest read this file right after gtest_discover_tests' own script has listed the tests
# (in ${remat_tests_TESTS}). Every test gets:
# - the folder of tests/ its suite is written in (ops, graph, plan, cli, ...);
# - one of `process` (it starts `remat` or other processes), `brute_force` (it holds the
#   planner to brute force: its name says BruteForce), `slow` (in-process, but a second or
#   more on the two-core machine: training runs, ranks on threads, timeouts waited out, the
#   cost model against measured peaks) and `unit` (in-process and fast: the inner loop);
# - and `tokenizer` when it loads the SentencePiece shim, in-process or in a `remat` it
#   starts, which the sanitizers refuse (scripts/sanitize.sh leaves these out).
# A new suite that starts processes or loads the shim, or a new test that is slow, joins
# its list here; a test's name is Suite.Test, without a parameterised test's prefix and
# parameter.
set(process_suites Cli InputCli Launch LaunchedTraining PipelineTraining Hosts Peers PlanAsTrained PlanAttention
    PlanLossHead CpuLoad)
set(tokenizer_suites Tokenizer Corpus TokenDataset Trainer Resume AttentionChoiceRun BenchAuto Cli InputCli
    PlanAsTrained Peers LaunchedTraining PipelineTraining Hosts)
set(slow_tests
    "(Trainer|Resume|PipelineStep|AttentionChoiceRun|BenchAuto)\\..*"
    "Comm\\.(ARankStillWaitingForOneThatFinished|RankZerosFailureInWork|ARankStartedBeforeRankZeros).*"
    "Corpus\\.(KingJamesBible|TokenFilesArePreparedAndReadInBoundedMemory)"
    "CostModel\\.(OffloadPlansPeak|PeakOfAMicrobatch|PlansOffloadingUnderAHostBudget|RandomKeepSets|TensorParallelRanks).*"
    "CudaBudget\\.EveryStagesReservedPeak.*"
    "DataParallel\\.TwoRanksSumOneProcesssParts.*"
    "MachineFit\\.OffloadAboveTheHostMemoryFree.*"
    "OffloadBitwise\\.EveryOffloadPlanEqualsNone.*"
    "Pipeline\\.(AReceiveThatNothing|OneStageLeaves|StagesExchange).*"
    "PipelinePlan\\.(OffloadNeverSlows|Plans32Layers).*"
    "StepSchedule\\.RandomStepsPeak.*"
    "StoreBitwise\\.LayersRunningTwoAttentionOps.*"
    "TimeProfile\\.(EveryRankTakesRankZeros|TheLinksAreCached).*"
    "Zero\\.(CheckpointsAreTheSameFile|DataParallelCopies).*")
list(JOIN process_suites "|" process_suites)
list(JOIN tokenizer_suites "|" tokenizer_suites)
list(JOIN slow_tests "|" slow_tests)

get_filename_component(root "${CMAKE_CURRENT_LIST_DIR}" DIRECTORY)
file(GLOB_RECURSE sources "${root}/tests/*.cpp")
foreach(source IN LISTS sources)
  file(RELATIVE_PATH folder "${root}/tests" "${source}")
  get_filename_component(folder "${folder}" DIRECTORY)
  file(STRINGS "${source}" lines REGEX "^TEST(_F|_P)?\\(")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^TEST(_F|_P)?\\(([A-Za-z0-9_]+),.*" "\\2" suite "${line}")
    set(folder_of_${suite} "${folder}")
  endforeach()
endforeach()

foreach(test IN LISTS remat_tests_TESTS)
  # "Suite.Test", or "Prefix/Suite.Test/parameter" for a parameterised test.
  string(REGEX REPLACE "^([^./]*/)?([A-Za-z0-9_]+)\\.([A-Za-z0-9_]+).*" "\\2;\\3" parts "${test}")
  list(GET parts 0 suite)
  list(GET parts 1 name)
  set(labels ${folder_of_${suite}})
  if(suite MATCHES "^(${process_suites})$")
    list(APPEND labels process)
  elseif(name MATCHES "BruteForce")
    list(APPEND labels brute_force)
  elseif("${suite}.${name}" MATCHES "^(${slow_tests})$")
    list(APPEND labels slow)
  else()
    list(APPEND labels unit)
  endif()
  if(suite MATCHES "^(${tokenizer_suites})$")
    list(APPEND labels tokenizer)
  endif()
  set_tests_properties("${test}" PROPERTIES LABELS "${labels}")
endforeach()
