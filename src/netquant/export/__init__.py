"""netquant.export"""
