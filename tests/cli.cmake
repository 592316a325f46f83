# CLI behaviour tests for `v4attn` (included from CMakeLists.txt): exit codes, --help, --version,
# the plan output and malformed configs. Each runs through tests/cli_expect.sh, which checks the
# exit code, the number of stderr lines and regexes on stdout/stderr (see its header).
set(_v4attn_cli_expect "${CMAKE_CURRENT_LIST_DIR}/cli_expect.sh")
set(_v4attn_cli_configs "${CMAKE_CURRENT_LIST_DIR}/configs")

# v4attn_cli_test(NAME <cli_expect.sh options> -- <v4attn arguments>)
function(v4attn_cli_test name)
  set(args ${ARGN})
  list(FIND args "--" sep)
  if(sep EQUAL -1)
    message(FATAL_ERROR "v4attn_cli_test(${name}): missing -- before the v4attn arguments")
  endif()
  math(EXPR after "${sep} + 1")
  list(LENGTH args n)
  if(after EQUAL n)
    list(APPEND args "$<TARGET_FILE:v4attn>")
  else()
    list(INSERT args ${after} "$<TARGET_FILE:v4attn>")
  endif()
  add_test(NAME cli.${name} COMMAND sh "${_v4attn_cli_expect}" ${args})
  set_tests_properties(cli.${name} PROPERTIES LABELS cli TIMEOUT 60)
endfunction()

# --- the bytes floor of a cycle from the plan alone (no GPU) ---
v4attn_cli_test(plan_floor --exit 0 --stderr-lines 0
  --stdout "^  verify bs 1 +6 +2\\.160 +15\\.6 +509\\.6 +5480$" --stdout "^  decode bs 8 +8 +2\\.160 +124\\.8 +535\\.1 +-$"
  -- plan --floor verify:1 --floor decode:8)
v4attn_cli_test(plan_floor_bad_shape --exit 2 --stderr-lines 1 --stderr "--floor takes decode:BS or verify:BS"
  -- plan --floor verify:0)
v4attn_cli_test(plan_floor_bad_mode --exit 2 --stderr-lines 1 --stderr "--floor takes" -- plan --floor prefill:2)

# --- help and version: exit 0, text on stdout, nothing on stderr ---
v4attn_cli_test(help --exit 0 --stderr-lines 0 --stdout "Subcommands:" --stdout "^ +plan " -- --help)
v4attn_cli_test(version --exit 0 --stderr-lines 0
  --stdout "^v4attn [0-9]+\\.[0-9]+\\.[0-9]+ \\(commit ([0-9a-f]{12}|unknown)[,)]" -- --version)
v4attn_cli_test(plan_help --exit 0 --stderr-lines 0 --stdout "--config FILE" --stdout "--tp" -- plan --help)
v4attn_cli_test(main_help --exit 0 --stderr-lines 0 --stdout "Usage: v4attn main" -- main --help)

# --- plan on the embedded V4.1-Flash config ---
v4attn_cli_test(plan --exit 0 --stderr-lines 0 --stdout "reuse"
  --stdout "modes: 2 window-only, 4 full, 4 reindex, 30 reuse, 3 draft" -- plan)
v4attn_cli_test(plan_tp4 --exit 0 --stderr-lines 0 --stdout "tp 4 \\(16 heads, 8 index heads" -- plan --tp 4)
v4attn_cli_test(plan_config_file --exit 0 --stderr-lines 0 --stdout "30 reuse"
  -- plan --config "${CMAKE_SOURCE_DIR}/configs/deepseek-v4.1-flash.json")
find_program(V4ATTN_PYTHON3 python3)
if(V4ATTN_PYTHON3)
  v4attn_cli_test(plan_json --exit 0 --stderr-lines 0
    --stdout-json "d['counts'] == {'window-only': 2, 'full': 4, 'reindex': 4, 'reuse': 30, 'draft': 3} and len(d['layers']) == 43 and d['layers'][25]['idx_src'] == 24"
    -- plan --json)
  # The prepare's weights (the bytes floor's) against the attention's, per weight and per layer.
  v4attn_cli_test(plan_json_prepare_weights --exit 0 --stderr-lines 0
    --stdout-json "sum(l['prepare_weight_bytes'] for l in d['layers'][:40]) == 2160304128 and all((w['use'] == 'attention') == (w['name'] in ('attn_sink', 'wo_a', 'wo_b', 'wo_b.scale')) for l in d['layers'] for w in l['weights'])"
    -- plan --json)
  v4attn_cli_test(plan_floor_json --exit 0 --stderr-lines 0
    --stdout-json "[round(f['us'], 1) for f in d['floors']] == [509.6, 622.8] and d['floors'][1]['pytorch_reference_us'] == 7440 and d['floors'][0]['rows'] == 6"
    -- plan --json --floor verify:1 --floor decode:32)
  v4attn_cli_test(plan_json_tp4 --exit 0 --stderr-lines 0
    --stdout-json "d['local_heads'] == 16 and d['tp'] == 4" -- plan --json --tp 4)
  # scripts/trace_layers.py on a two-layer fixture trace: per-layer time, the side-lane tail past
  # q_rope_store, the detail listing with each kernel's own time (the top-k launched at 11 after the
  # scores' end at 10 on its stream: own 14); a trace without layers is refused with exit 2.
  add_test(NAME scripts.trace_layers
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/trace_layers.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/trace_two_layers.json" --detail 1)
  set_tests_properties(scripts.trace_layers PROPERTIES PASS_REGULAR_EXPRESSION
    "1 +25\\.0 +20\\.0 +12\\.0 +25\\.0 +13\\.0  indexer_topk_v3_kernel.*2 layers, 45\\.0 us; side lanes past q_rope_store: 13\\.0 us.*stream +28 +4\\.0 \\.\\. +10\\.0 +6\\.0  indexer_scores_kernel<1, 1, 3, 0>.*stream +28 +11\\.0 \\.\\. +25\\.0 +14\\.0  indexer_topk_v3_kernel")
  # A fused Q chain layer (kernels/qchain.h) starts a layer and ends its main lane; so does a QA
  # GEMM that quantises x itself (its kFused flag), and a GEMM without it does not. "chain": the
  # main lane's end after the previous layer's (24, 52 - 24, 82 - 52).
  add_test(NAME scripts.trace_layers_fused
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/trace_layers.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/trace_fused_layer.json")
  set_tests_properties(scripts.trace_layers_fused PROPERTIES PASS_REGULAR_EXPRESSION
    "0 +26\\.0 +24\\.0 +24\\.0 +24\\.0 +0\\.0  qchain_fused_kernel<8>.*1 +34\\.0 +28\\.0 +26\\.0 +26\\.0 +0\\.0  q_rope_store_kernel.*2 +22\\.0 +30\\.0 +22\\.0 +22\\.0 +0\\.0  q_rope_store_kernel.*3 layers, 82\\.0 us")
  # The wq_b GEMM that stores q with the RoPE itself (v2's kRope form, `--fuse-rope-store`) ends a
  # layer's main lane like q_rope_store; the plain wq_b GEMM does not (the next layer's q_rope_store does).
  add_test(NAME scripts.trace_layers_rope_fused
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/trace_layers.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/trace_rope_fused.json")
  set_tests_properties(scripts.trace_layers_rope_fused PROPERTIES PASS_REGULAR_EXPRESSION
    "0 +36\\.0 +35\\.0 +35\\.0 +35\\.0 +0\\.0  gemm_fp8_wgmma_kernel<2, 16, true>.*1 +36\\.0 +37\\.0 +36\\.0 +36\\.0 +0\\.0  q_rope_store_kernel")
  # scripts/phase_stamps.py on a v2 fixture (launch ids): CTAs grouped by launch, the hand-off view
  # (entry and PDL-wait times after the previous launch's end); an old file refuses --handoff.
  add_test(NAME scripts.phase_stamps_v2
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt")
  set_tests_properties(scripts.phase_stamps_v2 PROPERTIES PASS_REGULAR_EXPRESSION
    "qchain +2 14i:0\\.0 14a:0\\.1 0i:0\\.2 0a:0\\.3 1i:1\\.0 1a:1\\.1 11a:21\\.0\n+qchain +2 14i:5\\.0 14a:21\\.3 0i:5\\.2 0a:21\\.5 1i:21\\.7 1a:25\\.0 11a:41\\.0")
  add_test(NAME scripts.phase_stamps_handoff
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt" --handoff)
  set_tests_properties(scripts.phase_stamps_handoff PROPERTIES PASS_REGULAR_EXPRESSION
    "qchain +2 +21\\.0 +-16\\.00 +0\\.30 +0\\.70 +4\\.00 +36\\.00\nmedian qchain +1 launches: last wait 4\\.00 us after the previous end, length 36\\.00 us")
  # --intervals: per-CTA intervals between consecutive phases of the fused chain's launches (both
  # launches, 4 CTAs: 0 -> 1 is 0.8 / 0.8 / 16.5 / 3.5 us) and each phase after the previous launch's
  # end (the second launch only); an unknown kind is refused.
  add_test(NAME scripts.phase_stamps_intervals
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt" --intervals qchain)
  set_tests_properties(scripts.phase_stamps_intervals PROPERTIES PASS_REGULAR_EXPRESSION
    "qchain: 2 launches, 4 CTAs\n.*\n +14 -> +0 +4 +0\\.20 +0\\.20 +0\\.20 +0\\.20\n +0 -> +1 +4 +0\\.80 +2\\.15 +16\\.50 +16\\.50\n +1 -> +11 +4 +16\\.00 +18\\.65 +19\\.90 +19\\.90\n.*\n +14 +2 +-16\\.00 +-7\\.85 +0\\.30 +0\\.30\n +0 +2 +-15\\.80 +-7\\.65 +0\\.50 +0\\.50\n +1 +2 +0\\.70 +2\\.35 +4\\.00 +4\\.00\n +11 +2 +19\\.00 +19\\.50 +20\\.00 +20\\.00")
  # --intervals v2 on a distributed-q_norm GEMM v2 launch after a v3 launch (session 29): the path
  # walks the rows-written (10) and every-row-seen (11) phases between the PDL wait and the first
  # stage; per CTA 1 -> 10 is 0.2 / 0.1 us, 10 -> 11 1.3 / 1.1, 11 -> 2 2.0 / 2.3 (the v3 launch ends
  # at 2.0 us).
  add_test(NAME scripts.phase_stamps_intervals_v2_qdist
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2_qdist.txt" --intervals v2)
  set_tests_properties(scripts.phase_stamps_intervals_v2_qdist PROPERTIES PASS_REGULAR_EXPRESSION
    "v2: 1 launches, 2 CTAs\n.*\n +0 -> +1 +2 +0\\.90 +0\\.95 +1\\.00 +1\\.00\n +1 -> +10 +2 +0\\.10 +0\\.15 +0\\.20 +0\\.20\n +10 -> +11 +2 +1\\.10 +1\\.20 +1\\.30 +1\\.30\n +11 -> +2 +2 +2\\.00 +2\\.15 +2\\.30 +2\\.30\n.*\n +11 +2 +2\\.00 +2\\.10 +2\\.20 +2\\.20")
  # --intervals topk_v3 on two one-row top-k launches of a decode bs 1 cycle (4 CTAs each, session
  # 18): the selection's phase path (wait, pass p's histogram / exchange / digit at 4+4p..6+4p,
  # compaction 20, end 21), not the GEMMs' (where 14 is the CTA's entry); the first launch ran three
  # passes, the second two (the whole-bucket short cut: 10 -> 20).
  add_test(NAME scripts.phase_stamps_intervals_select
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_select.txt" --intervals topk_v3)
  set_tests_properties(scripts.phase_stamps_intervals_select PROPERTIES PASS_REGULAR_EXPRESSION
    "topk_v3: 2 launches, 8 CTAs\n.*\n +1 -> +4 +8 +1\\.98 +2\\.02 +2\\.02 +2\\.02\n.*\n +13 -> +14 +4 +0\\.64 +0\\.67 +0\\.67 +0\\.67\n +14 -> +20 +4 +1\\.63 +1\\.66 +1\\.70 +1\\.70\n +20 -> +21 +8 .*\n +10 -> +20 +4 +1\\.57 +1\\.63 +1\\.73 +1\\.73\n")
  # --followed-by / --not-followed-by: the fused chains followed by a top-k (a reindex layer's: the
  # third, 1 -> 11 27 us, 11 at 30 us after the previous end) apart from the others (three launches,
  # the last one after the top-k: 0 at 1 us after its end); both refused without --intervals or
  # with an unknown kind.
  add_test(NAME scripts.phase_stamps_intervals_followed_by
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_followed.txt" --intervals qchain --followed-by topk_v3)
  set_tests_properties(scripts.phase_stamps_intervals_followed_by PROPERTIES PASS_REGULAR_EXPRESSION
    "qchain: 1 launches, 1 CTAs\n.*\n +1 -> +11 +1 +27\.00 +27\.00 +27\.00 +27\.00\n.*\n +11 +1 +30\.00 +30\.00 +30\.00 +30\.00")
  add_test(NAME scripts.phase_stamps_intervals_not_followed_by
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_followed.txt" --intervals qchain --not-followed-by topk_v3)
  set_tests_properties(scripts.phase_stamps_intervals_not_followed_by PROPERTIES PASS_REGULAR_EXPRESSION
    "qchain: 3 launches, 3 CTAs\n.*\n +1 -> +11 +3 +17\.50 +18\.00 +19\.00 +19\.00\n.*\n +0 +2 +1\.00 +1\.00 +1\.00 +1\.00")
  add_test(NAME scripts.phase_stamps_followed_by_needs_intervals
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_followed.txt" --followed-by topk_v3)
  set_tests_properties(scripts.phase_stamps_followed_by_needs_intervals PROPERTIES WILL_FAIL TRUE)
  add_test(NAME scripts.phase_stamps_followed_by_unknown_kind
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_followed.txt" --intervals qchain --followed-by gemm9)
  set_tests_properties(scripts.phase_stamps_followed_by_unknown_kind PROPERTIES WILL_FAIL TRUE)
  add_test(NAME scripts.phase_stamps_intervals_unknown_kind
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt" --intervals gemm9)
  set_tests_properties(scripts.phase_stamps_intervals_unknown_kind PROPERTIES WILL_FAIL TRUE)
  # --stages on a fixture with GEMM v3 and v2 per-stage records (96 + it data landed, 112 + it slot
  # free, 64 + it converted): the per-launch cells of CTA 0 and the per-kind median intervals.
  add_test(NAME scripts.phase_stamps_stages
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_stages.txt" --stages)
  set_tests_properties(scripts.phase_stamps_stages PROPERTIES PASS_REGULAR_EXPRESSION
    "v3 +at +0\\.0 us: stage data/slot/done 0:3\\.10/3\\.20/3\\.70 1:4\\.10/4\\.20/4\\.80 2:5\\.20/5\\.40/5\\.90; loop done 7\\.00\nv2 +at +10\\.0 us: stage data/slot/done 0:2\\.00/2\\.10/2\\.40 1:2\\.80/2\\.90/3\\.20; loop done 4\\.00\nmedian v2 +: data 0\\.80 us after the previous stage's \\(1 intervals\\), conversion 0\\.30 us\nmedian v3 +: data 1\\.05 us after the previous stage's \\(2 intervals\\), conversion 0\\.50 us")
  add_test(NAME scripts.phase_stamps_stages_old_file
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/phase_stamps.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_stages_v1.txt" --stages)
  set_tests_properties(scripts.phase_stamps_stages_old_file PROPERTIES WILL_FAIL TRUE)
  # scripts/ncu_sass_summary.py on a five-instruction fixture of ncu's SASS source export: opcodes
  # with predicates folded (two PRMTs), counts per unit of work (--per 100), stall shares, the
  # hottest instruction first; a file that is not such an export is refused.
  add_test(NAME scripts.ncu_sass_summary
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ncu_sass_summary.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ncu_sass_small.csv" --per 100 --top 1)
  set_tests_properties(scripts.ncu_sass_summary PROPERTIES PASS_REGULAR_EXPRESSION
    "2500 warp instructions \\(25\\.0 per unit\\), 100 stall samples.*PRMT +16\\.0 +64\\.0% +10\\.0%.*IMMA\\.16832\\.S8\\.S8 +4\\.0 +16\\.0% +50\\.0%.*0x7f0000000030 +4\\.00 +50  IMMA")
  add_test(NAME scripts.ncu_sass_summary_not_an_export
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ncu_sass_summary.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt")
  set_tests_properties(scripts.ncu_sass_summary_not_an_export PROPERTIES WILL_FAIL TRUE)
  # --regions / --count on a fixture with per-reason stall columns: two execution counts (a 3-instruction
  # "loop" run 500 times, a load run 10 times), their shares and top reasons, the selection's reasons
  # ("(Not Issued)" columns not counted); a count no instruction has is refused.
  add_test(NAME scripts.ncu_sass_summary_regions
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ncu_sass_summary.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ncu_sass_regions.csv" --regions --count 500 --top 1)
  set_tests_properties(scripts.ncu_sass_summary_regions PROPERTIES PASS_REGULAR_EXPRESSION
    "500 +3 +99\\.3% +60\\.0%  wait 58%, selected 42%.*10 +1 +0\\.7% +40\\.0%  long_sb 100%.*only the 3 instructions executed 500 times.*1500 warp instructions.*stall reasons \\(samples\\): wait 58\\.3%, selected 41\\.7%")
  add_test(NAME scripts.ncu_sass_summary_no_such_count
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ncu_sass_summary.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ncu_sass_regions.csv" --count 7)
  set_tests_properties(scripts.ncu_sass_summary_no_such_count PROPERTIES WILL_FAIL TRUE)
  # scripts/sass_loop_hazards.py on a cuobjdump fixture of two functions. The first (one loop, no PDL
  # wait): the division and the load copied into another register inside the loop are reported, the
  # same shapes before the loop and a load whose register is written again before the copy are not.
  # The second: after its ACQBULK, a division and a call of a routine holding I2F.U64.RP are
  # reported with their distance from the wait; a division before the wait, the routine's own body,
  # a call of a routine without a division and a division inside a loop (reported as a loop hazard)
  # are not. A file without a function is refused.
  add_test(NAME scripts.sass_loop_hazards
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_loop_hazards.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass")
  set_tests_properties(scripts.sass_loop_hazards PROPERTIES PASS_REGULAR_EXPRESSION
    "_Z9fixture_kPi: 14 instructions, 2 hazards in loops, 0 after the PDL wait\n  integer division 0x0040  loop 0x0040-0x00c0  I2F\\.U32\\.RP R5, R6\n  load then copy   0x0060  loop 0x0040-0x00c0  @!P3 LDG\\.E R17, desc\\[UR20\\]\\[R22\\.64\\]  -> IMAD\\.MOV\\.U32 R127, RZ, RZ, R17 \\(2 instructions later\\)\n_Z10fixture_w2Pi: 14 instructions, 1 hazard in loops, 2 after the PDL wait\n  integer division 0x0060  loop 0x0050-0x0070  I2F\\.RP R7, R9\n  division         0x0030  wait 0x0010 \\+2     I2F\\.U32\\.RP R5, R6\n  division call    0x0040  wait 0x0010 \\+3     CALL\\.REL\\.NOINC 0xa0\n2 functions, 5 hazards")
  add_test(NAME scripts.sass_loop_hazards_not_sass
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_loop_hazards.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt")
  set_tests_properties(scripts.sass_loop_hazards_not_sass PROPERTIES WILL_FAIL TRUE)
  # scripts/sass_compare.py: the fixture above against a copy whose first function differs only in a
  # branch target (addresses are dropped: same) and whose second differs in one operand (differs, same
  # opcodes; exit 1); a file against itself (exit 0); a file without a function is refused (exit 2).
  add_test(NAME scripts.sass_compare
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass" "${CMAKE_SOURCE_DIR}/tests/data/sass_compare_b.sass")
  set_tests_properties(scripts.sass_compare PROPERTIES PASS_REGULAR_EXPRESSION
    "differs     14 ->    14  _Z10fixture_w2Pi  \\[same opcodes, other operands\\]\nsame        14  _Z9fixture_kPi\n1 of 2 functions differ")
  add_test(NAME scripts.sass_compare_differ_exit
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass" "${CMAKE_SOURCE_DIR}/tests/data/sass_compare_b.sass")
  set_tests_properties(scripts.sass_compare_differ_exit PROPERTIES WILL_FAIL TRUE)
  add_test(NAME scripts.sass_compare_same
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass" "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass")
  set_tests_properties(scripts.sass_compare_same PROPERTIES PASS_REGULAR_EXPRESSION "\n0 of 2 functions differ")
  add_test(NAME scripts.sass_compare_not_sass
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/sass_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/sass_loop_hazards.sass" "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt")
  set_tests_properties(scripts.sass_compare_not_sass PROPERTIES WILL_FAIL TRUE)
  # scripts/ptx_compare.py: a fixture pair whose kernel was renamed, renumbered and moved (same code once
  # --map names it) and whose helper changed a constant (differs; exit 1); without --map the renamed
  # kernel is in one file only; a file against itself (exit 0); a file without a function (exit 2).
  add_test(NAME scripts.ptx_compare
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ptx_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx" "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_b.ptx"
                   --map _Z6kernelPi=_Z7kernel2Pi)
  set_tests_properties(scripts.ptx_compare PROPERTIES PASS_REGULAR_EXPRESSION
    "differs     10 ->    10  _Z6helperi  \\[-1 \\+1 lines\\]\nsame        11  _Z7kernel2Pi\n1 of 2 functions differ")
  add_test(NAME scripts.ptx_compare_differ_exit
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ptx_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx" "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_b.ptx"
                   --map _Z6kernelPi=_Z7kernel2Pi)
  set_tests_properties(scripts.ptx_compare_differ_exit PROPERTIES WILL_FAIL TRUE)
  add_test(NAME scripts.ptx_compare_unmapped
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ptx_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx" "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_b.ptx")
  set_tests_properties(scripts.ptx_compare_unmapped PROPERTIES PASS_REGULAR_EXPRESSION
    "only in a: _Z6kernelPi\nonly in b: _Z7kernel2Pi\n3 of 3 functions differ")
  add_test(NAME scripts.ptx_compare_same
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ptx_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx" "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx")
  set_tests_properties(scripts.ptx_compare_same PROPERTIES PASS_REGULAR_EXPRESSION "\n0 of 2 functions differ")
  add_test(NAME scripts.ptx_compare_not_ptx
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ptx_compare.py"
                   "${CMAKE_SOURCE_DIR}/tests/data/ptx_compare_a.ptx" "${CMAKE_SOURCE_DIR}/tests/data/stamps_v2.txt")
  set_tests_properties(scripts.ptx_compare_not_ptx PROPERTIES WILL_FAIL TRUE)
  # scripts/ab_cycles.py: the interleaved commands of two variants over two shapes (--dry-run, no GPU
  # needed), and its usage errors (exit 2).
  add_test(NAME scripts.ab_cycles_dry_run
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin v4attn --variant base=
                   "--variant" "win=--select-window --select-cluster 8" --shape verify:1 --shape decode:32 --reps 2 --dry-run)
  set_tests_properties(scripts.ab_cycles_dry_run PROPERTIES PASS_REGULAR_EXPRESSION
    "^v4attn bench --mode verify --bs 1 --cycles 20 --trace-cycles 0 --schedule three-lane --json [^ ]+\nv4attn bench --mode verify --bs 1 [^\n]+ --select-window --select-cluster 8\nv4attn bench --mode verify --bs 1 [^\n]+json [^ ]+\nv4attn bench --mode verify --bs 1 [^\n]+ --select-window --select-cluster 8\nv4attn bench --mode decode --bs 32 ")
  # A variant with its own executable (a baseline build): its runs use that binary, the others --bin.
  add_test(NAME scripts.ab_cycles_variant_bin
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin v4attn
                   --variant base@.gpu/base-bb4a38e/v4attn= --variant head= --shape verify:4 --reps 1 --dry-run)
  set_tests_properties(scripts.ab_cycles_variant_bin PROPERTIES PASS_REGULAR_EXPRESSION
    "^\\.gpu/base-bb4a38e/v4attn bench --mode verify --bs 4 [^\n]+\nv4attn bench --mode verify --bs 4 ")
  add_test(NAME scripts.ab_cycles_variant_empty_bin
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr "needs an executable after '@'" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --variant base@=
                   --shape decode:1 --dry-run)
  # Its real path over a stand-in bench (tests/data/fake_v4attn_bench.py: no GPU): interleaved runs, their
  # median, the change against the first variant, the builds; differing digests or a failing run fail.
  set(_fake_bench "${CMAKE_SOURCE_DIR}/tests/data/fake_v4attn_bench.py")
  add_test(NAME scripts.ab_cycles_fake_runs
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin "${_fake_bench}" --variant a=
                   "--variant" "b=--fake-us 10 --fake-no-build" --shape verify:1 --shape decode:2 --reps 2)
  set_tests_properties(scripts.ab_cycles_fake_runs PROPERTIES PASS_REGULAR_EXPRESSION
    "verify 1 +a +1000\\.0 / 1001\\.0 +1000\\.5 +\\+0\\.00 % +2\\.00x +d0\nverify 1 +b +1010\\.5 / 1011\\.5 +1011\\.0 +\\+1\\.05 % +2\\.02x +d0\ndecode 2 +a +1002\\.0 / 1003\\.0 .*build of a: 0123456789ab .*build of b: \\? ")
  add_test(NAME scripts.ab_cycles_fake_digest_differs
           COMMAND sh "${_v4attn_cli_expect}" --exit 1 --stderr "output digests differ" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin "${_fake_bench}" --variant a=
                   "--variant" "b=--fake-digest d1" --shape verify:1 --reps 1)
  add_test(NAME scripts.ab_cycles_fake_digest_allowed
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin "${_fake_bench}" --variant a=
                   "--variant" "b=--fake-digest d1" --shape verify:1 --reps 1 --allow-digest-change)
  set_tests_properties(scripts.ab_cycles_fake_digest_allowed PROPERTIES PASS_REGULAR_EXPRESSION "verify 1 +b .* d1\n")
  add_test(NAME scripts.ab_cycles_fake_no_json
           COMMAND sh "${_v4attn_cli_expect}" --exit 1 --stderr "no result from" -- "${V4ATTN_PYTHON3}"
                   "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin "${_fake_bench}" --variant a=
                   "--variant" "b=--fake-no-json" --shape verify:1 --reps 1)
  add_test(NAME scripts.ab_cycles_fake_run_fails
           COMMAND sh "${_v4attn_cli_expect}" --exit 1 --stderr "failed .exit 1." -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --bin "${_fake_bench}" --variant a=
                   "--variant" "b=--fake-fail" --shape verify:1 --reps 1)
  # The GPU staging helpers refuse bad arguments before they build or unpack anything.
  add_test(NAME scripts.gpu_stage_bad_argument
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr-lines 1 --stderr "unknown argument '--bogus'"
                   -- bash "${CMAKE_SOURCE_DIR}/scripts/gpu_stage.sh" --bogus)
  add_test(NAME scripts.gpu_stage_bad_base
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr-lines 1 --stderr "unknown revision 'no-such-rev'"
                   -- bash "${CMAKE_SOURCE_DIR}/scripts/gpu_stage.sh" --base no-such-rev)
  add_test(NAME scripts.next_run_bad_group
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr-lines 1 --stderr "unknown group 'bogus'"
                   -- bash "${CMAKE_SOURCE_DIR}/scripts/next_run.sh" window bogus)
  add_test(NAME scripts.gpu_run_bad_step
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr-lines 1 --stderr "unknown step 'bogus'"
                   -- bash "${CMAKE_SOURCE_DIR}/scripts/gpu_run.sh" tests bogus)
  # scripts/issue6_report.py over fixture JSONs: the best exact version per GEMM target with its share of
  # the floor and 1-ulp fraction, a peer without an algorithm, unmeasured targets counted unmet; the
  # cycles' ratio to the floor and speed-up over PyTorch; the count of targets met.
  add_test(NAME scripts.issue6_report_fixtures
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/issue6_report.py"
                   --gemm "${CMAKE_SOURCE_DIR}/tests/data/issue6_gemm.json"
                   --cycle "${CMAKE_SOURCE_DIR}/tests/data/issue6_cycle_verify1.json"
                   --cycle "${CMAKE_SOURCE_DIR}/tests/data/issue6_cycle_decode8.json")
  set_tests_properties(scripts.issue6_report_fixtures PROPERTIES PASS_REGULAR_EXPRESSION
    "\\| wq_b \\| 1 \\| v2 \\| 11\\.48 \\| 85\\.8 % \\(met\\) \\| 0\\.012 % \\| 22\\.20 \\| no algorithm \\|.*\\| wq_a_wkv \\| 1 \\| v6 \\| 5\\.56 \\| 38\\.7 % \\(not met\\).*\\| wq_a_wkv \\| 48 \\| not measured .*\\| verify bs 1 \\| 6 \\| 509\\.6 us \\| 1148\\.0 us \\(three-lane\\) \\| 2\\.25x \\(not met\\) \\| 5\\.48 ms \\| 4\\.77x \\(not met\\) \\|.*\\| decode bs 8 \\| 8 \\| 535\\.1 us \\| 600\\.0 us \\(three-lane\\) \\| 1\\.12x \\(met\\) \\| - \\| - \\|.*\\| decode bs 32 \\| - \\| - \\| not measured .*issue 6 targets met: 2 of 21")
  add_test(NAME scripts.issue6_report_missing_file
           COMMAND sh "${_v4attn_cli_expect}" --exit 1 --stderr "cannot read /nonexistent/cycle.json" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/issue6_report.py" --cycle /nonexistent/cycle.json)
  add_test(NAME scripts.issue6_report_no_inputs
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr "give --gemm and / or --cycle files" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/issue6_report.py")
  add_test(NAME scripts.ab_cycles_bad_shape
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr "a shape is decode:BS or verify:BS" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --variant base= --shape verify:x --dry-run)
  add_test(NAME scripts.ab_cycles_same_names
           COMMAND sh "${_v4attn_cli_expect}" --exit 2 --stderr "variant names must differ" -- "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/ab_cycles.py" --variant a= --variant a=--eager
                   --shape decode:1 --dry-run)
  add_test(NAME scripts.trace_layers_no_layers
           COMMAND "${V4ATTN_PYTHON3}" "${CMAKE_SOURCE_DIR}/scripts/trace_layers.py"
                   "${CMAKE_SOURCE_DIR}/tests/configs/missing_key.json")
  set_tests_properties(scripts.trace_layers_no_layers PROPERTIES WILL_FAIL TRUE)
else()
  message(STATUS "python3 not found: cli.plan_json* tests (JSON validation) not added")
endif()
v4attn_cli_test(main --exit 0 --stderr-lines 0 --stdout "running the CPU reference on the reduced config" -- main)

# --- usage errors: exit 2, one line on stderr ---
v4attn_cli_test(no_subcommand --exit 2 --stderr-lines 1 --stderr "^v4attn: .*subcommand" --)
v4attn_cli_test(unknown_subcommand --exit 2 --stderr-lines 1
  --stderr "^v4attn: unknown subcommand \"frobnicate\"" -- frobnicate)
v4attn_cli_test(unknown_option --exit 2 --stderr-lines 1 --stderr "^v4attn: .*--bogus" -- plan --bogus)
v4attn_cli_test(plan_tp_not_a_number --exit 2 --stderr-lines 1 --stderr "^v4attn: .*--tp" -- plan --tp x)
v4attn_cli_test(plan_bad_tp --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in <embedded default>: key \"n_heads\": 64 is not divisible by tp 3$"
  -- plan --tp 3)
v4attn_cli_test(plan_tp_zero --exit 2 --stderr-lines 1 --stderr "^v4attn: config error in .*tp 0" -- plan --tp 0)

# --- malformed configs: exit 2, one line on stderr naming the file and the key ---
v4attn_cli_test(config_missing_file --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/no_such_config\\.json: cannot open"
  -- plan --config "${_v4attn_cli_configs}/no_such_config.json")
v4attn_cli_test(config_truncated --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/truncated\\.json: invalid JSON at byte [0-9]+: .*end of input"
  -- plan --config "${_v4attn_cli_configs}/truncated.json")
v4attn_cli_test(config_missing_key --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/missing_key\\.json: missing required key \"dim\"$"
  -- plan --config "${_v4attn_cli_configs}/missing_key.json")
v4attn_cli_test(config_string_for_number --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/string_for_number\\.json: key \"n_heads\": expected an integer, got string"
  -- plan --config "${_v4attn_cli_configs}/string_for_number.json")
v4attn_cli_test(config_float_for_int --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/float_for_int\\.json: key \"dim\": expected an integer, got float"
  -- plan --config "${_v4attn_cli_configs}/float_for_int.json")
v4attn_cli_test(config_ratios_too_short --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/ratios_too_short\\.json: key \"compress_ratios\": has 42 entries"
  -- plan --config "${_v4attn_cli_configs}/ratios_too_short.json")
v4attn_cli_test(config_source_ratio_zero --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/source_ratio_zero\\.json: key \"kv_source_layers\": layer 1 has compress ratio 0"
  -- plan --config "${_v4attn_cli_configs}/source_ratio_zero.json")
v4attn_cli_test(config_unsorted_sources --exit 2 --stderr-lines 1
  --stderr "^v4attn: config error in .*/unsorted_sources\\.json: key \"index_source_layers\": not sorted"
  -- plan --config "${_v4attn_cli_configs}/unsorted_sources.json")
v4attn_cli_test(main_bad_argument --exit 2 --stderr-lines 1 --stderr "^v4attn: " -- main --bogus)

# --- main: the CPU reference path (tools/cmd_main.cpp). cli_expect.sh keeps only its last --stdout
# regex, so each property is its own test. ---
v4attn_cli_test(main_cpu --exit 0 --stderr-lines 0
  --stdout "^(no GPU|CPU path \\(--cpu\\)): running the CPU reference on the reduced config" -- main --cpu)
v4attn_cli_test(main_cpu_first_layer --exit 0 --stderr-lines 0 --stdout "^ +0 +0 window-only +QA QB KV ATT +[0-9a-f]{16} "
  -- main --cpu --context 1024)
v4attn_cli_test(main_cpu_last_layer --exit 0 --stderr-lines 0
  --stdout "^ +11 +1 reuse +QA QB KV ATT +[0-9a-f]{16} [0-9a-f]{16} [0-9a-f]{16} +- +- +[0-9]+ +[0-9.]+$" -- main --cpu --context 1024)
v4attn_cli_test(main_cpu_summary --exit 0 --stderr-lines 0
  --stdout "^summary: 12 layers, verify bs 1 \\(6 rows\\) at context 1024: .*stack checksum [0-9a-f]{16}$"
  -- main --cpu --context 1024)
v4attn_cli_test(main_cpu_decode --exit 0 --stderr-lines 0 --stdout "^summary: 4 layers, decode bs 2 \\(2 rows\\)"
  -- main --cpu --mode decode --bs 2 --context 300 --layers 4)
v4attn_cli_test(main_cpu_dump --exit 0 --stderr-lines 0 --stdout "^dump: [0-9]+ tensors in .*cli_main_dump"
  -- main --cpu --context 300 --dump "${CMAKE_BINARY_DIR}/cli_main_dump" --dump-layers 2,6-7)
if(V4ATTN_PYTHON3)
  v4attn_cli_test(main_cpu_json --exit 0
    --stdout-json "len(d['layers']) == 12 and [l['layer'] for l in d['layers']] == list(range(12)) and all(l['attention'] for l in d['layers']) and d['layers'][6]['work'] == 'QA QB KV CMP IDX' and d['layers'][8]['topk_count'] > 0 and d['prefill']['groups'] == 1536"
    -- main --cpu --context 1024 --json -)
endif()
v4attn_cli_test(main_bad_mode --exit 2 --stderr-lines 1 --stderr "^v4attn: .*--mode" -- main --cpu --mode prefill)
v4attn_cli_test(main_dump_layers_without_dump --exit 2 --stderr-lines 1
  --stderr "^v4attn: --dump-layers needs --dump DIR$" -- main --cpu --dump-layers 3)
v4attn_cli_test(main_dump_layers_out_of_range --exit 2 --stderr-lines 1
  --stderr "^v4attn: --dump-layers: 3-99 is outside the layers 0..12$"
  -- main --cpu --dump "${CMAKE_BINARY_DIR}/cli_main_dump_bad" --dump-layers 3-99)

# --- bench: help, and usage errors (refused before any GPU work, so they run without a GPU) ---
v4attn_cli_test(bench_help --exit 0 --stderr-lines 0 --stdout "Usage: v4attn bench" --stdout "--schedule" -- bench --help)
v4attn_cli_test(bench_bad_mode --exit 2 --stderr-lines 1 --stderr "mode" -- bench --mode sideways)
v4attn_cli_test(bench_bad_schedule --exit 2 --stderr-lines 1 --stderr "schedule" -- bench --schedule fastest)
v4attn_cli_test(bench_bad_fuse_qchain --exit 2 --stderr-lines 1 --stderr "fuse-qchain" -- bench --fuse-qchain always)
v4attn_cli_test(bench_bad_fuse_x_quant --exit 2 --stderr-lines 1 --stderr "fuse-x-quant" -- bench --fuse-x-quant yes)
v4attn_cli_test(bench_bad_v3_int_mask --exit 2 --stderr-lines 1 --stderr "v3-int-mask" -- bench --v3-int-mask 16)
v4attn_cli_test(bench_help_fusion_knobs --exit 0 --stderr-lines 0 --stdout "--fuse-qchain TEXT:\\{auto,on,off\\}=auto"
  --stdout "--fuse-x-quant TEXT:\\{auto,on,off\\}=auto" --stdout "--no-idx-x-on-k" -- bench --help)
